"""Triton flash-decoding kernel with a tree mask: one program per (batch x head, block of queries, key
split) runs an online softmax over its key range (no mask load for the shared prefix), writes a normalised
partial output and its log-sum-exp; the splits are merged in torch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def tree_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, lse_ptr,
                          q_heads, group, num_queries, kv_len, head_dim, prefix_len, split_len, scale,
                          sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, smb, smq,
                          BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    qblock = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = bh // q_heads
    h = bh % q_heads
    kvh = h // group
    rows = qblock * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < num_queries
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        kt = tl.load(k_ptr + b * skb + kvh * skh + cols[None, :] * skn + dims[:, None],
                     mask=dim_ok[:, None] & col_ok[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision="ieee") * scale
        tail = cols - prefix_len
        tail_ok = row_ok[:, None] & col_ok[None, :] & (tail[None, :] >= 0)
        seen = tl.load(mask_ptr + b * smb + rows[:, None] * smq + tail[None, :], mask=tail_ok, other=0)
        allowed = col_ok[None, :] & ((cols[None, :] < prefix_len) | (seen != 0))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + b * svb + kvh * svh + cols[:, None] * svn + dims[None, :],
                     mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        m_i = m_new
    seen_any = l_i > 0
    out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    lse = tl.where(seen_any, m_i + tl.log(tl.where(seen_any, l_i, 1.0)), float("-inf"))
    part = (bh * num_splits + split) * num_queries + rows
    tl.store(out_ptr + part[:, None] * head_dim + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + part, lse, mask=row_ok)


def tree_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                          prefix_len: int, scale: float, keys_per_split: int = 512) -> torch.Tensor:
    """Same contract as ``tree_attention.tree_attention_reference``."""
    batch, q_heads, nq, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = allowed.to(torch.int8).contiguous()
    if mask.shape[-1] == 0:  # nothing beyond the prefix: a valid pointer that is never read
        mask = torch.zeros(batch, nq, 1, dtype=torch.int8, device=q.device)
    block_n = 32
    num_splits = max(1, min(16, triton.cdiv(kv_len, keys_per_split)))
    split_len = triton.cdiv(triton.cdiv(kv_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(kv_len, split_len)
    block_q = 16
    out = torch.empty(batch * q_heads, num_splits, nq, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch * q_heads, num_splits, nq, dtype=torch.float32, device=q.device)
    grid = (batch * q_heads, triton.cdiv(nq, block_q), num_splits)
    tree_attention_kernel[grid](
        q, k, v, mask, out, lse, q_heads, q_heads // kv_heads, nq, kv_len, head_dim, prefix_len, split_len,
        float(scale), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0), mask.stride(1),
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    if num_splits == 1:
        merged = out[:, 0]
    else:  # log-sum-exp merge of the key splits
        top = lse.max(dim=1, keepdim=True).values
        weight = torch.exp(lse - torch.nan_to_num(top, neginf=0.0))
        merged = (weight[..., None] * out).sum(1) / weight.sum(1).clamp(min=1e-30)[..., None]
    return merged.view(batch, q_heads, nq, head_dim).to(q.dtype)
