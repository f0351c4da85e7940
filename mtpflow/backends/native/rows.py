"""A verify forward's rows as the native decoder stacks take them: every sequence's root and draft nodes one after
another (no padding), each with its pool slot, its write position, the prefix it sees and its tree mask. Both native
backends (float32: ``cpu``, int8: ``int8``) describe their verifies with ``verify_rows``."""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch

from mtpflow.backends.base import tree_allowed
from mtpflow.backends.hf import own_taps
from mtpflow.backends.native import kernel
from mtpflow.backends.native.threads import GOVERNOR
from mtpflow.types import Verification

# prompt rows per kernel call of a prefill: bounds its scratch (scores: rows x heads x context floats)
PREFILL_ROWS = 256


@dataclass
class VerifyRows:
    """One verify forward's rows as the decoder stacks take them (``mtpflow_llama_rows``, ``mtpflow_w8a8_rows``):
    every sequence's root and draft nodes one after another, no padding. Row r feeds ``ids[r]`` at rope
    ``positions[r]`` into pool slot ``slots[r]`` at ``wpos[r]``, seeing the slot's first ``prefix[r]`` entries and
    the new entries of its own sequence (rows ``first[r]`` .. + ``count[r]``) that ``allowed[r]`` marks."""
    ids: torch.Tensor        # [rows]
    positions: torch.Tensor  # [rows]
    allowed: torch.Tensor    # uint8 [rows, the most rows of one sequence]
    slots: list[int]
    wpos: list[int]
    prefix: list[int]
    first: list[int]
    count: list[int]
    starts: list[int]        # each sequence's first row
    counts: list[int]        # each sequence's rows


def verify_rows(targets, roots, drafts, root_positions) -> VerifyRows:
    """The rows of ONE verify forward over every target's root and chain or tree (``Backend.verify``'s arguments),
    each written after the target's committed entries. Built over Python lists, each tensor made once: this runs
    once per step, and a step of the default model is a few milliseconds."""
    ids, positions, masks, counts = [], [], [], []
    for target, root, draft, root_position in zip(targets, roots, drafts, root_positions):
        base = root_position - target.position_shift
        ids.append(int(root))
        positions.append(base)
        if draft.num_nodes:
            ids += draft.tokens.tolist()
            positions += [base + d for d in draft.depth_list()]
            masks.append(tree_allowed(draft.parents))
        else:
            masks.append(None)
        counts.append(1 + draft.num_nodes)
    allowed = torch.zeros(sum(counts), max(counts), dtype=torch.uint8)
    rows = VerifyRows(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), allowed,
                      [], [], [], [], [], [], counts)
    start = 0
    for target, n, mask in zip(targets, counts, masks):
        length = target.kv.length
        if mask is not None:
            allowed[start:start + n, :n] = mask
        else:  # the root alone sees itself
            allowed[start, 0] = 1
        rows.slots += [target.kv.slot] * n
        rows.wpos += range(length, length + n)
        rows.prefix += [length] * n
        rows.first += [start] * n
        rows.count += [n] * n
        rows.starts.append(start)
        start += n
    return rows


def verify_through(run, targets, roots, drafts, root_positions) -> list[Verification]:
    """A backend's ``verify`` through its decoder stack: every target's root and draft (``verify_rows``) in ONE
    ``run(pool, rows, taps)`` call that returns (logits [rows, vocab] float32, the taps [rows, ...] or None), each
    target's entries then counted as written. One ``Verification`` per target: its rows' logits and the taps it
    asked for."""
    t0 = time.perf_counter()
    rows = verify_rows(targets, roots, drafts, root_positions)
    taps = tuple(sorted({t for target in targets for t in target.taps}))
    logits, hidden = run(targets[0].pool, rows, taps)
    seconds = time.perf_counter() - t0
    # what steps read from the logits (the gate's argmax, the loop's probabilities, and the top ids where a target's
    # stages read them: token recycling), in one pass over all rows
    stats = kernel.logit_stats(logits, GOVERNOR.threads(forward=False), top=max(target.top_ids for target in targets))
    results = []
    for target, n, first in zip(targets, rows.counts, rows.starts):
        target.kv.length += n
        target.forwards += 1
        h = own_taps(hidden[first:first + n], taps, target.taps) if hidden is not None and target.taps else None
        v = Verification(logits=logits[first:first + n], hidden=h, forward_seconds=seconds)
        if stats is not None:
            argmax, log_norm, top_ids = stats
            v = v.with_row_stats(argmax[first:first + n], log_norm[first:first + n],
                                 None if top_ids is None else top_ids[first:first + n])
        results.append(v)
    return results


def one_row(token: int, position: int, slot: int, at: int) -> VerifyRows:
    """One row (a self-draft step): ``token`` at rope ``position``, its entry written at ``at`` of pool slot ``slot``,
    seeing the slot's first ``at`` entries and itself."""
    return VerifyRows(torch.tensor([token]), torch.tensor([position]), torch.ones(1, 1, dtype=torch.uint8), [slot],
                      [at], [at], [0], [1], [0], [1])


def prefill_rows(target, tokens: torch.Tensor, start: int, chunk: int = PREFILL_ROWS):
    """A prompt's rows for a prefill over ``target``'s slot, in chunks of at most ``chunk`` rows (each after the
    entries the previous ones wrote: the caller advances ``target.kv.length`` by each chunk's rows before the
    next): ``(VerifyRows, head_from)`` per chunk, ``head_from`` the chunk's last row in the prompt's last chunk
    (the prefill's logits), None in the others. Each row sees the slot's entries and its chunk's rows up to
    itself (causal)."""
    n = int(tokens.numel())
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        rows, length = hi - lo, target.kv.length
        allowed = torch.ones(rows, rows, dtype=torch.bool).tril_().to(torch.uint8)
        positions = torch.arange(start + lo, start + hi) - target.position_shift
        yield (VerifyRows(tokens[lo:hi], positions, allowed, [target.kv.slot] * rows, list(range(length, length + rows)),
                          [length] * rows, [0] * rows, [rows] * rows, [0], [rows]),
               rows - 1 if hi == n else None)


def prefill_through(run, targets, prompts, starts=None) -> list:
    """A backend's ``prefill`` through its decoder stack: each target's prompt in chunks (``prefill_rows``), each
    chunk one ``run(pool, rows, taps, head_from)`` call that returns (logits or None, taps or None). Returns
    ``(logits [1, vocab] of the last row, the taps [len, ...] or None)`` per target."""
    starts = starts or [0] * len(targets)
    out = []
    for target, tokens, start in zip(targets, prompts, starts):
        parts, logits = [], None
        for rows, last in prefill_rows(target, tokens, start):
            logits, hidden = run(target.pool, rows, target.taps, last)
            target.kv.length += len(rows.slots)
            if hidden is not None:
                parts.append(hidden)
        target.forwards += 1
        out.append((logits, torch.cat(parts) if parts else None))
    return out


def call_members(rows: VerifyRows, rope: dict, rope_keys: list, taps: tuple[int, ...], h: torch.Tensor):
    """The struct members of one call that both decoder stacks take for ``rows`` (``mtpflow_llama_rows``,
    ``mtpflow_w8a8_rows``): each row's ints (slot, wpos, prefix, first, count, pos), its tree mask, each layer's
    rotary table at the rows' positions (``rope``: {key: ``description.RopeTable``}, ``rope_keys``: each layer's
    key or None) and the outputs of the layers ``taps`` names (shaped as ``h`` [rows, H]). Returns (members,
    {layer: its output tensor}, what the pointers point into: keep it alive until the call returns)."""
    m = len(rows.slots)
    ints = torch.tensor([rows.slots, rows.wpos, rows.prefix, rows.first, rows.count, rows.positions.tolist()],
                        dtype=torch.int32)  # one tensor, a row per member: one allocation a call
    base = ints.data_ptr()
    members = {name: base + 4 * m * i for i, name in enumerate(("slot", "wpos", "prefix", "first", "count", "pos"))}
    members.update(allowed=rows.allowed.data_ptr(), qmax=rows.allowed.shape[1], M=len(rows.slots))
    tables = {key: table.rows(rows.positions) for key, table in rope.items()}
    for index, name in enumerate(("cos", "sin")):
        members[name] = None if not tables else (ctypes.c_void_p * len(rope_keys))(
            *[None if key is None else tables[key][index].data_ptr() for key in rope_keys])
    tapped = {t: torch.empty_like(h) for t in taps if t >= 0}
    members["taps"] = None if not tapped else (ctypes.c_void_p * len(rope_keys))(
        *[tapped[i].data_ptr() if i in tapped else None for i in range(len(rope_keys))])
    return members, tapped, [ints, tables]


def tap_outputs(tapped: dict, normed: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor | None:
    """The taps a call returns [rows, H * len(taps)] (layer outputs, -1 the final-normed state), or None."""
    if not taps:
        return None
    tapped[-1] = normed
    return torch.cat([tapped[t] for t in taps], dim=-1) if len(taps) > 1 else tapped[taps[0]]


def optional(tensors) -> ctypes.Array | None:
    """A struct member for an optional per-layer part: None where no layer has it, else L pointers (NULL where a
    layer lacks it)."""
    if all(t is None for t in tensors):
        return None
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])
