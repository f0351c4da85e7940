"""Pure-torch references of the native kernels' entry points (gemm.c, rows_float.c), for the harness that checks every
build against them (tests/kernels/test_native_harness.py): the three products as ``F.linear`` over the weight each
reads, and ``mtpflow_llama_rows`` (a whole Llama decoder stack over rows of several sequences, writing their keys
and values into the KV pool) written out layer by layer. They compute in the dtype they are given (float64 for
a reference the float32 kernels are measured against)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

def small_gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``mtpflow_small_gemm``: x [M, K], weight [N, K], bias [N] or None -> [M, N]."""
    return F.linear(x, weight, bias)


def unpack_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The weight [n, K] that ``products.pack_panels`` laid out as panels [ceil(n / 64), K, 64]."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


def panel_gemm_reference(x: torch.Tensor, panels: torch.Tensor, n: int,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``mtpflow_panel_gemm``: x [M, K] times the weight the panels hold, [n, K] (only the first n outputs)."""
    return F.linear(x, unpack_panels(panels, n).to(x.dtype), bias)


def small_gemm_q8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``mtpflow_small_gemm_q8``: x [M, K] times int8 weights q [N, K], each output feature times scale[n]."""
    return F.linear(x, q.to(x.dtype) * scale.to(x.dtype)[:, None], bias)


@dataclass
class LlamaLayerWeights:
    """One decoder layer's weights as ``mtpflow_llama_rows`` reads them (float; an int8 copy's reference is its
    dequantized weight, ``q * scale[:, None]``)."""
    ln1: torch.Tensor   # [H] input RMSNorm weight
    wqkv: torch.Tensor  # [(nh + 2 nkv) d, H] q rows, then k rows, then v rows
    wo: torch.Tensor    # [H, nh d]
    ln2: torch.Tensor   # [H] post-attention RMSNorm weight
    wgu: torch.Tensor   # [2 I, H] gate rows, then up rows
    wd: torch.Tensor    # [H, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: x * rsqrt(mean(x^2) + eps), then times the weight."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's half-split rotation: (x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def llama_rows_reference(h: torch.Tensor, layers: list[LlamaLayerWeights], norm: torch.Tensor, eps: float,
                         keys: list[torch.Tensor], values: list[torch.Tensor], slot: list[int], wpos: list[int],
                         prefix: list[int], count: list[int], allowed: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, scale: float, nh: int, nkv: int, d: int):
    """``mtpflow_llama_rows`` over M rows, in the dtype of ``h``. Returns (h_out [M, H]: the last layer's output,
    normed [M, H]: its final norm, keys, values: copies of the per-layer pools [slots, nkv, capacity, d] with every
    row's new entries written).

    Row r belongs to the sequence in pool slot ``slot[r]``; each layer writes its rotated key and its value at
    ``wpos[r]`` of that slot, then (after every row has written) row r attends to the slot's first ``prefix[r]``
    entries and to entries ``prefix[r] + j`` (j < ``count[r]``: its sequence's new entries, written by the rows of
    its group in this call) where ``allowed[r, j]`` (uint8 [M, qmax]) is set. The kernel also takes each row's
    group's first row (``first``), which it does not read: the group's entries are found by position, so a caller
    must write row ``first + j``'s entry at ``prefix + j``. cos, sin: [M, d] at each row's position."""
    dtype = h.dtype
    m, nq, nk = h.shape[0], nh * d, nkv * d
    group = nh // nkv
    keys = [k.to(dtype).clone() for k in keys]
    values = [v.to(dtype).clone() for v in values]
    cos, sin = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]  # [M, 1, d]: every head of a row alike
    rows, slots, writes = torch.arange(m), torch.tensor(slot), torch.tensor(wpos)
    for layer, k_pool, v_pool in zip(layers, keys, values):
        w = {name: getattr(layer, name).to(dtype) for name in ("ln1", "wqkv", "wo", "ln2", "wgu", "wd")}
        qkv = F.linear(rms_norm(h, w["ln1"], eps), w["wqkv"])
        q = qkv[:, :nq].reshape(m, nh, d)
        k = qkv[:, nq:nq + nk].reshape(m, nkv, d)
        v = qkv[:, nq + nk:].reshape(m, nkv, d)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        for j in range(nkv):
            k_pool[slots, j, writes] = k[:, j]
            v_pool[slots, j, writes] = v[:, j]
        att = torch.empty(m, nh, d, dtype=dtype)
        for r in rows.tolist():
            seen = prefix[r] + count[r]
            visible = torch.ones(seen, dtype=torch.bool)
            visible[prefix[r]:] = allowed[r, :count[r]].bool()
            for j in range(nh):
                kv_head = j // group
                scores = (k_pool[slot[r], kv_head, :seen] @ q[r, j]) * scale
                weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=0)
                att[r, j] = weights @ v_pool[slot[r], kv_head, :seen]
        h = h + F.linear(att.reshape(m, nq), w["wo"])
        gate, up = F.linear(rms_norm(h, w["ln2"], eps), w["wgu"]).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, w["wd"])
    return h, rms_norm(h, norm.to(dtype), eps), keys, values
