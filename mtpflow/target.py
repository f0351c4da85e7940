"""The target model and each sequence's KV cache: prefill, the verify forward (one sequence, or every running
sequence in ONE forward), and the commit that keeps only the accepted path.

A sequence's cache (its row of ``mtpflow.kv_cache.KVPool``) holds every committed token except the root (the
last committed token); a verify forward feeds the root plus the draft nodes, so the cache grows by
``1 + num_nodes`` and the commit gathers back ``root + accepted path`` inside the row and sets the length:
rolling back a rejected draft costs nothing, and the model never runs again.
"""
from __future__ import annotations

import time

import torch

from mtpflow import forward as lean_forward
from mtpflow.kv_cache import BatchCache, KVPool, SequenceKV
from mtpflow.prefix_cache import PrefixKVCache, block_hashes
from mtpflow.types import Draft, Verification


def tree_allowed(parents: torch.Tensor) -> torch.Tensor:
    """[1 + num_nodes, 1 + num_nodes] bool: row i may attend to column j (the root, itself, its ancestors)."""
    n = int(parents.numel())
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True  # every node sees the root
    for i, p in enumerate(parents.tolist()):
        row = i + 1
        allowed[row, row] = True
        if p >= 0:
            allowed[row] |= allowed[p + 1]
    return allowed


def tree_attention_mask(parents: torch.Tensor, cached_len: int, dtype=torch.float32) -> torch.Tensor:
    """[1, 1, 1 + num_nodes, cached_len + 1 + num_nodes] additive mask for the root plus the draft nodes.

    Every row sees the cached prefix, the root and its own ancestors (itself included); 0 where allowed,
    the dtype's minimum where blocked.
    """
    allowed = tree_allowed(parents)
    n = allowed.shape[0]
    mask = torch.zeros(n, cached_len + n, dtype=dtype)
    mask[:, cached_len:] = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)
    return mask[None, None]


class Target:
    """A Hugging Face causal LM plus one sequence's KV cache (a slot of a pool shared with the batch)."""

    def __init__(self, model, need_hidden=False, pool: KVPool | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        # which hidden states its forwards return (``mtpflow.forward.hidden_taps``): () none, (-1,) the last one
        self.taps = lean_forward.taps_of(need_hidden)
        self.pool = pool or KVPool(model, max_slots=1)  # standalone use (tests, cost measurements)
        self.kv = SequenceKV(self.pool)
        # absolute position - position_shift = position the model sees; grows when ``keep`` evicts entries,
        # so cache entry i always sits at model position i and generation can run past the model's context
        self.position_shift = 0
        self.forwards = 0
        # its stages read only the argmax of each verify row (greedy gate, no distribution consumer): a verify
        # forward of such sequences alone may take the certified int8 LM head (mtpflow.kernels.certified_head)
        self.argmax_only = False

    @property
    def cache_len(self) -> int:
        """Entries in this sequence's cache."""
        return self.kv.length

    @cache_len.setter
    def cache_len(self, value: int) -> None:  # rolling back by position: later entries are simply overwritten
        self.kv.length = int(value)

    @property
    def cache(self):
        """A batch-1 Hugging Face ``Cache`` over this sequence's entries (for a self-draft or a plugin's forward)."""
        return self.kv.view()

    def release(self) -> None:
        """Give the cache slot back to the pool (the sequence has left the batch)."""
        self.kv.release()

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 last_only: bool = False):
        cache = self.kv.view()
        ids = input_ids.to(self.device)[None]
        positions = (position_ids - self.position_shift).to(self.device)[None]
        mask = None if mask is None else mask.to(self.device, self.model.dtype)
        logits, hidden = lean_forward.run(self.model, ids, positions, mask, cache, self.taps,
                                          logits_to_keep=1 if last_only else 0)
        self.kv.length = cache.layers[0].length
        self.forwards += 1
        return logits[0].float(), (hidden[0].float() if hidden is not None else None)

    @torch.inference_mode()
    def prefill_cached(self, tokens: torch.Tensor, prefix_cache: PrefixKVCache):
        """``prefill`` through a prefix cache: the longest stored prefix of ``tokens`` is copied into this (empty)
        cache and only the rest runs; then the prompt's whole blocks are stored for later prompts. Returns
        ``(logits, hidden, reused)``, ``reused`` the prompt tokens that came from the cache."""
        reused, hashes, stored = self._reuse_prefix(tokens, prefix_cache)
        logits, rest = self.prefill(tokens[reused:], start_position=reused)
        hidden = _join_hidden(stored, rest)
        self._store_prefix(tokens, prefix_cache, hidden, hashes)
        return logits, hidden, reused

    def _reuse_prefix(self, tokens: torch.Tensor, prefix_cache: PrefixKVCache):
        """Copy the longest stored prefix of ``tokens`` into this (empty) cache: (its length, the prompt's block
        hashes, the stored taps of those positions or None)."""
        hashes = block_hashes(tokens, int(tokens.numel()))
        hit = prefix_cache.lookup(tokens, self.taps, hashes)
        if hit is None:
            return 0, hashes, None
        entry, reused = hit
        self.pool.ensure(reused)
        for layer in range(self.pool.num_layers):
            self.kv.set_layer(layer, entry.keys[layer][None, :, :reused], entry.values[layer][None, :, :reused])
        self.kv.length = reused
        return reused, hashes, (None if entry.hidden is None else entry.hidden[:reused])

    def _store_prefix(self, tokens: torch.Tensor, prefix_cache: PrefixKVCache, hidden, hashes) -> None:
        n, row = int(tokens.numel()), self.kv.slot
        prefix_cache.store(tokens, [k[row, :, :n] for k in self.pool.keys], [v[row, :, :n] for v in self.pool.values],
                           taps=self.taps, hidden=hidden, hashes=hashes)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, start_position: int = 0):
        """Run the prompt into the cache. Returns (logits [1, vocab] of the last row only, hidden [len, h]).

        Only the last row goes through the LM head (``logits_to_keep=1`` where the model takes it)."""
        positions = torch.arange(start_position, start_position + tokens.numel())
        logits, hidden = self._forward(tokens, positions, None, last_only=True)
        return logits[-1:], hidden

    @torch.inference_mode()
    def verify(self, root: int, draft: Draft, root_position: int) -> Verification:
        """One forward of this sequence alone over the root and every draft node; chains use the causal mask."""
        t0 = time.perf_counter()
        done = _verify_native(self.model, [self], [root], [draft], [root_position], t0)
        if done is not None:
            return done[0]
        ids = torch.cat([torch.tensor([root], dtype=torch.long), draft.tokens])
        if draft.num_nodes == 0 or draft.is_chain:
            positions = torch.arange(root_position, root_position + ids.numel())
            mask = None
        else:
            positions = torch.cat([torch.tensor([root_position]), root_position + draft.depths()])
            mask = tree_attention_mask(draft.parents, self.cache_len, dtype=self.model.dtype)
        logits, hidden = self._forward(ids, positions, mask)
        return Verification(logits=logits, hidden=hidden, forward_seconds=time.perf_counter() - t0)

    @torch.inference_mode()
    def commit(self, start: int, num_nodes: int, accepted: torch.Tensor) -> None:
        """Keep the root (at cache index ``start``) and the accepted nodes; drop the other draft entries."""
        n_accepted = int(accepted.numel())
        is_prefix = n_accepted == 0 or bool(torch.equal(accepted, torch.arange(n_accepted)))
        if not is_prefix:
            self.kv.gather(start + 1, start + 1 + accepted)
        self.kv.length = start + 1 + n_accepted

    @torch.inference_mode()
    def keep(self, index: torch.Tensor) -> None:
        """Keep only the cache entries at ``index`` (ascending; sliding window eviction).

        The kept entries are moved to contiguous positions 0..n-1 (StreamingLLM assigns positions within the
        cache): RoPE keys are rotated by (new - old position), and later inputs are shifted by the number
        of evicted entries. Models without a rotary embedding keep their keys as they are.
        """
        idx = index.to(self.device)
        delta = torch.arange(idx.numel(), device=self.device) - idx  # [n_keep] new - old position, <= 0
        rotary = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        for layer in range(self.pool.num_layers):
            row = self.kv.slot
            keys = self.pool.keys[layer][row : row + 1, :, : self.cache_len].index_select(2, idx)
            values = self.pool.values[layer][row : row + 1, :, : self.cache_len].index_select(2, idx)
            if rotary is not None and bool((delta != 0).any()):
                keys = rotate_keys(keys, delta, rotary)
            self.kv.set_layer(layer, keys, values)
        self.position_shift += self.cache_len - int(index.numel())
        self.cache_len = int(index.numel())


# prompt rows per packed prefill forward (``prefill_many``): bounds its activations (about 12 KB per row for the
# default model's widest product, 25 MB at 2,048 rows); a longer prompt is prefilled alone
PACKED_PREFILL_ROWS = 2048


def _join_hidden(stored, rest):
    if rest is None:
        return None
    return rest if stored is None else torch.cat([stored, rest])


@torch.inference_mode()
def prefill_many(targets: list[Target], prompts: list[torch.Tensor], prefix_cache: PrefixKVCache | None = None):
    """Prefill several new sequences (empty caches) at once: ``(logits [1, vocab], hidden, reused)`` per target,
    as ``Target.prefill_cached`` returns. Where the model takes the lean forward, the prompts (each after the
    prefix it reuses from ``prefix_cache``) run packed, up to ``PACKED_PREFILL_ROWS`` rows per forward
    (``mtpflow.forward.forward_packed``: the products over every row at once, attention per sequence); else
    one by one. Prompts that start alike in one group do not reuse each other's prefix (each is looked up
    before any is stored)."""
    reuse = [t._reuse_prefix(p, prefix_cache) if prefix_cache is not None else (0, None, None)
             for t, p in zip(targets, prompts)]
    rests = [p[r[0]:] for p, r in zip(prompts, reuse)]
    outputs: list = [None] * len(targets)
    model = targets[0].model
    packable = len(targets) > 1 and lean_forward.supports(model)
    group: list[int] = []

    def run_group():
        if len(group) == 1:
            i = group[0]
            outputs[i] = targets[i].prefill(rests[i], start_position=reuse[i][0])
        elif group:
            outputs_group = _prefill_packed(model, [targets[i] for i in group], [rests[i] for i in group],
                                            [reuse[i][0] for i in group])
            for i, out in zip(group, outputs_group):
                outputs[i] = out
        group.clear()

    rows = 0
    for i, rest in enumerate(rests):
        n = int(rest.numel())
        if not packable or (group and rows + n > PACKED_PREFILL_ROWS):
            run_group()
            rows = 0
        group.append(i)
        rows += n
    run_group()
    results = []
    for target, prompt, (reused, hashes, stored), (logits, rest) in zip(targets, prompts, reuse, outputs):
        hidden = _join_hidden(stored, rest)
        if prefix_cache is not None:
            target._store_prefix(prompt, prefix_cache, hidden, hashes)
        results.append((logits, hidden, reused))
    return results


def _prefill_packed(model, targets: list[Target], tokens: list[torch.Tensor], starts: list[int]):
    """One packed forward over several targets' prompt rows: (logits [1, vocab], taps [n, ...] or None) each."""
    device = targets[0].device
    taps = tuple(sorted({t for target in targets for t in target.taps}))
    caches = [target.kv.view() for target in targets]
    positions = [torch.arange(start, start + int(t.numel()), device=device) for start, t in zip(starts, tokens)]
    logits, hidden = lean_forward.forward_packed(model, [t.to(device) for t in tokens], positions, caches, taps)
    out = []
    for i, (target, cache) in enumerate(zip(targets, caches)):
        target.kv.length = cache.layers[0].length
        target.forwards += 1
        own = None
        if hidden is not None and target.taps:
            own = _own_taps(hidden[i], taps, target.taps).float()
        out.append((logits[i:i + 1].float(), own))
    return out


@torch.inference_mode()
def verify_batch(model, targets: list[Target], roots: list[int], drafts: list[Draft],
                 root_positions: list[int]) -> list[Verification]:
    """ONE forward over every sequence in the pool: each row feeds its root plus its own draft (chain or
    tree, any size, none at all) over its own cache length.

    Layout: rows padded to the longest ``1 + num_nodes`` (the model takes ``[B, q]`` input ids); a 4D mask
    ``[B, 1, q, max_len + q]`` gives each row its prefix, its own tree and nothing of its padding, and
    ``position_ids [B, q]`` count from each sequence's first token. Pool slots that are not in ``targets``
    (a sequence still waiting for its prefill, or verifying alone) ride along as fully padded rows. The forward
    returns the union of the targets' hidden-state taps; each sequence gets its own taps back.
    """
    t0 = time.perf_counter()
    done = _verify_native(model, targets, roots, drafts, root_positions, t0)
    if done is not None:
        return done
    pool = targets[0].pool
    rows = pool.used
    by_slot = {t.kv.slot: i for i, t in enumerate(targets)}
    sizes = [1 + d.num_nodes for d in drafts]
    q = max(sizes)
    lengths = [owner.length for owner in pool.owners]
    cache = BatchCache(pool, lengths, q)
    dtype = model.dtype
    blocked = torch.finfo(dtype).min
    allowed = torch.zeros(rows, q, cache.kv_length, dtype=torch.bool)
    input_ids = torch.zeros(rows, q, dtype=torch.long)
    positions = torch.zeros(rows, q, dtype=torch.long)
    pad = torch.arange(q)
    for slot in range(rows):
        length = lengths[slot]
        allowed[slot, pad, length + pad] = True  # a padding row sees itself only (no empty softmax)
        i = by_slot.get(slot)
        if i is None:
            continue
        target, draft, n = targets[i], drafts[i], sizes[i]
        allowed[slot, :n, :length] = True
        allowed[slot, :n, length : length + n] = tree_allowed(draft.parents)
        input_ids[slot, 0] = roots[i]
        input_ids[slot, 1:n] = draft.tokens
        base = root_positions[i] - target.position_shift
        positions[slot] = base
        positions[slot, 1:n] = base + draft.depths()
    mask = torch.zeros(rows, 1, q, cache.kv_length, dtype=dtype).masked_fill_(~allowed[:, None], blocked)
    device = targets[0].device
    taps = tuple(sorted({t for target in targets for t in target.taps}))
    logits, hidden = lean_forward.run(model, input_ids.to(device), positions.to(device), mask.to(device), cache,
                                      taps)
    seconds = time.perf_counter() - t0
    logits = logits.float()
    hidden = hidden.float() if hidden is not None else None
    results = []
    for target, n in zip(targets, sizes):
        slot = target.kv.slot
        target.kv.length += n
        target.forwards += 1
        h = _own_taps(hidden[slot, :n], taps, target.taps) if hidden is not None and target.taps else None
        results.append(Verification(logits=logits[slot, :n], hidden=h, forward_seconds=seconds))
    return results


def _verify_native(model, targets, roots, drafts, root_positions, t0) -> list[Verification] | None:
    """A verify forward through ``mtpflow.forward.native_rows`` (every layer in one native call, only the real
    rows), or None where it does not apply (a sequence wants hidden states other than the last, or the model,
    the plan or the machine does not allow it: ``forward.native_for``), checked before any row is laid out."""
    if any(set(t.taps) - {-1} for t in targets):
        return None
    native = lean_forward.native_for(model, sum(1 + d.num_nodes for d in drafts))
    if native is None:
        return None
    ids, positions, allowed = [], [], []
    for target, root, draft, root_position in zip(targets, roots, drafts, root_positions):
        ids.append(torch.cat([torch.tensor([root], dtype=torch.long), draft.tokens]))
        base = root_position - target.position_shift
        if draft.num_nodes:
            positions.append(base + torch.cat([torch.zeros(1, dtype=torch.long), draft.depths()]))
            allowed.append(tree_allowed(draft.parents))
        else:
            positions.append(torch.tensor([base], dtype=torch.long))
            allowed.append(torch.ones(1, 1, dtype=torch.bool))
    logits, hidden, starts = lean_forward.native_rows(model, targets[0].pool, [t.kv.slot for t in targets],
                                                      [t.kv.length for t in targets], ids, positions, allowed,
                                                      native=native,
                                                      argmax_only=all(t.argmax_only for t in targets))
    seconds = time.perf_counter() - t0
    results = []
    for target, tokens, start in zip(targets, ids, starts):
        n = int(tokens.numel())
        target.kv.length += n
        target.forwards += 1
        h = hidden[start:start + n] if target.taps else None
        results.append(Verification(logits=logits[start:start + n].float(), hidden=h, forward_seconds=seconds))
    return results


def _own_taps(hidden: torch.Tensor, taps: tuple[int, ...], own: tuple[int, ...]) -> torch.Tensor:
    """[n, hidden * len(taps)] of the batch's taps -> [n, hidden * len(own)], this sequence's in its order."""
    if own == taps:
        return hidden
    size = hidden.shape[-1] // len(taps)
    return torch.cat([hidden[:, taps.index(t) * size : (taps.index(t) + 1) * size] for t in own], dim=-1)


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, rotary) -> torch.Tensor:
    """Apply a RoPE rotation by ``delta`` positions ([seq]) to cached keys [batch, heads, seq, head_dim].

    Rotations compose (R(a) R(b) = R(a + b)), so a key cached at position p becomes the key at p + delta.
    The rotary module's attention scaling is divided out: only the rotation is wanted.
    """
    cos, sin = rotary(keys.float(), position_ids=delta[None])  # [1, seq, rot_dim]
    scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    cos, sin = (cos.float() / scale)[:, None], (sin.float() / scale)[:, None]
    rot_dim = cos.shape[-1]
    k = keys[..., :rot_dim].float()
    half = rot_dim // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    out = keys.clone()
    out[..., :rot_dim] = (k * cos + rotated_half * sin).to(keys.dtype)
    return out
