"""The target model and its shared KV cache: prefill, the verify forward, and the commit that keeps only
the accepted path.

The cache holds every committed token except the root (the last committed token); a verify forward feeds
the root plus the draft nodes, so the cache grows by ``1 + num_nodes`` and the commit gathers back
``root + accepted path`` on the sequence dimension, without running the model again.
"""
from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from mtpflow.types import Draft, Verification


def tree_attention_mask(parents: torch.Tensor, cached_len: int, dtype=torch.float32) -> torch.Tensor:
    """[1, 1, 1 + num_nodes, cached_len + 1 + num_nodes] additive mask for the root plus the draft nodes.

    Every row sees the cached prefix, the root and its own ancestors (itself included); 0 where allowed,
    the dtype's minimum where blocked.
    """
    n = int(parents.numel())
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True  # every node sees the root
    allowed[0, 0] = True
    par = parents.tolist()
    for i, p in enumerate(par):
        row = i + 1
        allowed[row, row] = True
        if p >= 0:
            allowed[row] |= allowed[p + 1]
    mask = torch.zeros(n + 1, cached_len + n + 1, dtype=dtype)
    mask[:, cached_len:] = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)
    return mask[None, None]


class Target:
    """A Hugging Face causal LM plus the run's KV cache."""

    def __init__(self, model, need_hidden: bool = False):
        self.model = model
        self.device = next(model.parameters()).device
        self.need_hidden = need_hidden
        self.cache = DynamicCache(config=model.config)
        self.cache_len = 0  # entries in the cache
        # absolute position - position_shift = position the model sees; grows when ``keep`` evicts entries,
        # so cache entry i always sits at model position i and generation can run past the model's context
        self.position_shift = 0
        self.forwards = 0

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None):
        out = self.model(
            input_ids=input_ids.to(self.device)[None],
            position_ids=(position_ids - self.position_shift).to(self.device)[None],
            attention_mask=None if mask is None else mask.to(self.device, self.model.dtype),
            cache=self.cache,
            use_cache=True,
            output_hidden_states=self.need_hidden,
        )
        self.forwards += 1
        hidden = out.hidden_states[-1][0].float() if self.need_hidden else None
        return out.logits[0].float(), hidden

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, start_position: int = 0):
        """Run the prompt into the cache. Returns (logits [len, vocab] of the last row only, hidden [len, h])."""
        positions = torch.arange(start_position, start_position + tokens.numel())
        logits, hidden = self._forward(tokens, positions, None)
        self.cache_len += int(tokens.numel())
        return logits[-1:], hidden

    @torch.inference_mode()
    def verify(self, root: int, draft: Draft, root_position: int) -> Verification:
        """One forward over the root and every draft node; chains use the model's own causal mask."""
        t0 = time.perf_counter()
        ids = torch.cat([torch.tensor([root], dtype=torch.long), draft.tokens])
        if draft.num_nodes == 0 or draft.is_chain:
            positions = torch.arange(root_position, root_position + ids.numel())
            mask = None
        else:
            positions = torch.cat([torch.tensor([root_position]), root_position + draft.depths()])
            mask = tree_attention_mask(draft.parents, self.cache_len, dtype=self.model.dtype)
        logits, hidden = self._forward(ids, positions, mask)
        self.cache_len += int(ids.numel())
        return Verification(logits=logits, hidden=hidden, forward_seconds=time.perf_counter() - t0)

    @torch.inference_mode()
    def commit(self, start: int, num_nodes: int, accepted: torch.Tensor) -> None:
        """Keep the root (at cache index ``start``) and the accepted nodes; drop the other draft entries."""
        keep_tail = 1 + int(accepted.numel())
        n_accepted = int(accepted.numel())
        is_prefix = n_accepted == 0 or bool(torch.equal(accepted, torch.arange(n_accepted)))
        if not is_prefix:
            src = (start + 1 + accepted).to(self.device)
            for layer in self.cache.layers:
                layer.keys[:, :, start + 1 : start + 1 + n_accepted] = layer.keys.index_select(2, src)
                layer.values[:, :, start + 1 : start + 1 + n_accepted] = layer.values.index_select(2, src)
        drop = (1 + num_nodes) - keep_tail
        if drop > 0:
            self.cache.crop(-drop)
        self.cache_len = start + keep_tail

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
        for layer in self.cache.layers:
            keys = layer.keys.index_select(2, idx)
            if rotary is not None and bool((delta != 0).any()):
                keys = rotate_keys(keys, delta, rotary)
            layer.keys = keys
            layer.values = layer.values.index_select(2, idx)
        self.position_shift += self.cache_len - int(index.numel())
        self.cache_len = int(index.numel())


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
