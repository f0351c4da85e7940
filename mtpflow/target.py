"""One sequence's view of the target: its KV cache slot, its prefill and verify forwards (through the engine's
backend, ``mtpflow.backends``), and the commit that keeps only the accepted path.

A sequence's cache (its row of ``mtpflow.kv_cache.KVPool``) holds every committed token except the root (the
last committed token); a verify forward feeds the root plus the draft nodes, so the cache grows by
``1 + num_nodes`` and the commit gathers back ``root + accepted path`` inside the row and sets the length:
rolling back a rejected draft costs nothing, and the model never runs again.
"""
from __future__ import annotations

import torch

from mtpflow.backends.hf import reference
from mtpflow.forward import taps_of
from mtpflow.kv_cache import KVPool, SequenceKV
from mtpflow.prefix_cache import PrefixKVCache, block_hashes
from mtpflow.types import Draft, Verification


class Target:
    """One sequence's slot in the KV pool, with the backend that runs the target's forwards over it."""

    def __init__(self, backend, need_hidden=False, pool: KVPool | None = None):
        if isinstance(backend, torch.nn.Module):  # a bare model (tests, tools): the reference backend over it
            backend = reference(backend)
        self.backend = backend
        self.model = backend.model
        self.device = backend.device
        # which hidden states its forwards return (``mtpflow.types.hidden_taps``): () none, (-1,) the last one
        self.taps = taps_of(need_hidden)
        self.pool = pool or backend.make_pool(1)  # standalone use (tests, cost measurements)
        self.kv = SequenceKV(self.pool)
        # absolute position - position_shift = position the model sees; grows when ``keep`` evicts entries,
        # so cache entry i always sits at model position i and generation can run past the model's context
        self.position_shift = 0
        self.forwards = 0
        # its stages read only the argmax of each verify row (greedy gate, no distribution consumer): a backend
        # may compute such rows' logits with an exact argmax and bounded rest (``Backend.takes_argmax_only``)
        self.argmax_only = False
        # how many of each verify row's top ids its stages read (``Verification.top_ids``: token recycling): a backend
        # may compute them with the logits; 0: none is read
        self.top_ids = 0

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

    def prefill(self, tokens: torch.Tensor, start_position: int = 0):
        """Run the prompt into the cache. Returns (logits [1, vocab] of the last row only, hidden taps [len, ...])."""
        return self.backend.prefill([self], [tokens], starts=[start_position])[0]

    def verify(self, root: int, draft: Draft, root_position: int) -> Verification:
        """One forward of this sequence alone over the root and every draft node."""
        return self.backend.verify([self], [root], [draft], [root_position])[0]

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


def prefill_many(targets: list[Target], prompts: list[torch.Tensor], prefix_cache: PrefixKVCache | None = None):
    """Prefill several new sequences (empty caches, one backend) at once: ``(logits [1, vocab], hidden, reused)``
    per target, as ``Target.prefill_cached`` returns. Each prompt reuses what ``prefix_cache`` holds of it; the
    rests go to the backend together (packed where it can). Prompts that start alike in one group do not reuse
    each other's prefix (each is looked up before any is stored)."""
    reuse = [t._reuse_prefix(p, prefix_cache) if prefix_cache is not None else (0, None, None)
             for t, p in zip(targets, prompts)]
    outputs = targets[0].backend.prefill(targets, [p[r[0]:] for p, r in zip(prompts, reuse)],
                                         starts=[r[0] for r in reuse])
    results = []
    for target, prompt, (reused, hashes, stored), (logits, rest) in zip(targets, prompts, reuse, outputs):
        hidden = _join_hidden(stored, rest)
        if prefix_cache is not None:
            target._store_prefix(prompt, prefix_cache, hidden, hashes)
        results.append((logits, hidden, reused))
    return results


def _join_hidden(stored, rest):
    if rest is None:
        return None
    return rest if stored is None else torch.cat([stored, rest])


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
