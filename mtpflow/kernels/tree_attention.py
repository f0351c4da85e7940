"""Tree attention for the verify forward: every query (root or draft node) attends to the cached prefix and
to the tail keys its tree mask allows (its ancestors and itself). The reference is plain masked softmax
attention in float32; the Triton kernel (``tree_attention_triton``) is flash-decoding style: key blocks split
across programs with an online softmax, merged by log-sum-exp.

Shapes: q [batch, q_heads, num_queries, head_dim]; k, v [batch, kv_heads, kv_len, head_dim] (grouped-query
attention when q_heads is a multiple of kv_heads); allowed [batch, num_queries, kv_len - prefix_len] bool for
the tail keys; keys before ``prefix_len`` are visible to every query.
"""
from __future__ import annotations

import torch

from mtpflow.kernels.dispatch import resolve_impl


def full_mask(allowed: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[batch, num_queries, prefix_len + tail] bool: the prefix visible to all, then the tail mask."""
    b, nq, _ = allowed.shape
    prefix = torch.ones(b, nq, prefix_len, dtype=torch.bool, device=allowed.device)
    return torch.cat([prefix, allowed.bool()], dim=-1)


def causal_tail(batch: int, num_queries: int, device) -> torch.Tensor:
    """[batch, num_queries, num_queries] bool: query i sees tail keys 0..i (a chain or a prefill)."""
    return torch.ones(num_queries, num_queries, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                             prefix_len: int, scale: float | None = None) -> torch.Tensor:
    """[batch, q_heads, num_queries, head_dim] in q's dtype; a query that sees no key gets zeros."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~full_mask(allowed, prefix_len)[:, None], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return (probs @ values).to(q.dtype)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, prefix_len: int,
                   scale: float | None = None, impl: str | None = None) -> torch.Tensor:
    """Dispatcher for ``tree_attention_reference`` (same arguments; equal within float tolerance)."""
    if resolve_impl(impl, q.device) == "torch":
        return tree_attention_reference(q, k, v, allowed, prefix_len, scale)
    from mtpflow.kernels.tree_attention_triton import tree_attention_triton

    return tree_attention_triton(q, k, v, allowed, prefix_len, q.shape[-1] ** -0.5 if scale is None else scale)
