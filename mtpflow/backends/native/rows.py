"""A verify forward's rows as the native decoder stacks take them: every sequence's root and draft nodes one after
another (no padding), each with its pool slot, its write position, the prefix it sees and its tree mask. Both native
backends (float32: ``cpu``, int8: ``int8``) describe their verifies with ``verify_rows``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpflow.backends.base import tree_allowed


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
    each written after the target's committed entries."""
    ids, positions, masks = [], [], []
    for target, root, draft, root_position in zip(targets, roots, drafts, root_positions):
        ids.append(torch.cat([torch.tensor([root], dtype=torch.long), draft.tokens]))
        base = root_position - target.position_shift
        if draft.num_nodes:
            positions.append(base + torch.cat([torch.zeros(1, dtype=torch.long), draft.depths()]))
            masks.append(tree_allowed(draft.parents))
        else:
            positions.append(torch.tensor([base], dtype=torch.long))
            masks.append(torch.ones(1, 1, dtype=torch.bool))
    counts = [int(t.numel()) for t in ids]
    allowed = torch.zeros(sum(counts), max(counts), dtype=torch.uint8)
    rows = VerifyRows(torch.cat(ids), torch.cat(positions), allowed, [], [], [], [], [], [], counts)
    start = 0
    for target, n, mask in zip(targets, counts, masks):
        length = target.kv.length
        allowed[start:start + n, :n] = mask
        rows.slots += [target.kv.slot] * n
        rows.wpos += range(length, length + n)
        rows.prefix += [length] * n
        rows.first += [start] * n
        rows.count += [n] * n
        rows.starts.append(start)
        start += n
    return rows
