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
    """The weight [n, K] that ``products.pack_panels`` laid out as panels [ceil(n / PANEL), K, PANEL]."""
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
    dequantized weight, ``q * scale[:, None]``), and its optional parts (None where the layer lacks them)."""
    ln1: torch.Tensor   # [H] input RMSNorm scale
    wqkv: torch.Tensor  # [(nh + 2 nkv) d, H] q rows, then k rows, then v rows
    wo: torch.Tensor    # [H, nh d]
    ln2: torch.Tensor   # [H] the MLP's input RMSNorm scale
    wgu: torch.Tensor   # [2 I, H] gate rows, then up rows
    wd: torch.Tensor    # [H, I]
    post_attn: torch.Tensor | None = None  # [H] the norm of the attention's output, before the residual
    post_mlp: torch.Tensor | None = None   # [H] the norm of the MLP's output
    qn: torch.Tensor | None = None         # [d] each query head's norm, before the rotary
    kn: torch.Tensor | None = None         # [d] each key head's norm
    bqkv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    bgu: torch.Tensor | None = None
    bd: torch.Tensor | None = None
    window: int = 0                        # 0: every key; w: the keys of the last w positions
    cos: torch.Tensor | None = None        # [M, rot] this layer's table at each row's position (None: no rotary)
    sin: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: x * rsqrt(mean(x^2) + eps), then times the weight."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's half-split rotation: (x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [M, heads, d]: its first ``rot`` values of each head rotated by cos / sin [M, rot], the rest as they are."""
    rot = cos.shape[-1]
    turned = x[..., :rot] * cos[:, None] + rotate_half(x[..., :rot]) * sin[:, None]
    return torch.cat([turned, x[..., rot:]], dim=-1)


ACTIVATIONS = {0: F.silu, 1: lambda g: F.gelu(g, approximate="tanh")}  # description.SILU, GELU_TANH


def llama_rows_reference(h: torch.Tensor, layers: list[LlamaLayerWeights], norm: torch.Tensor, eps: float,
                         keys: list[torch.Tensor], values: list[torch.Tensor], slot: list[int], wpos: list[int],
                         prefix: list[int], first: list[int], count: list[int], positions: list[int],
                         allowed: torch.Tensor, scale: float, nh: int, nkv: int, d: int, act: int = 0,
                         softcap: float = 0.0, taps: tuple[int, ...] = ()):
    """``mtpflow_llama_rows`` over M rows, in the dtype of ``h``. Returns (h_out [M, H]: the last layer's output,
    normed [M, H]: its final norm, keys, values: copies of the per-layer pools [slots, nkv, capacity, d] with every
    row's new entries written, {layer: its output} for ``taps``).

    Row r belongs to the sequence in pool slot ``slot[r]``; each layer writes its key (normed and rotated where the
    layer does) and its value at ``wpos[r]`` of that slot, then (after every row has written) row r attends to the
    slot's first ``prefix[r]`` entries and to entries ``prefix[r] + j`` (j < ``count[r]``: its sequence's new
    entries, written by rows ``first[r] + j`` of its group in this call) where ``allowed[r, j]`` (uint8 [M, qmax])
    is set; in a layer with a sliding window w only those at positions ``positions[r] - w + 1`` and later (a prefix
    entry's position is its index). Scores are ``q . k * scale``, soft-capped where ``softcap``; the MLP is
    ``act(gate) * up``."""
    dtype = h.dtype
    m, nq, nk = h.shape[0], nh * d, nkv * d
    group = nh // nkv
    keys = [k.to(dtype).clone() for k in keys]
    values = [v.to(dtype).clone() for v in values]
    slots, writes = torch.tensor(slot), torch.tensor(wpos)
    tapped = {}

    def linear(x, w, b):
        return F.linear(x, w, None if b is None else b.to(dtype))

    def normed(x, w):
        return x if w is None else rms_norm(x, w.to(dtype), eps)

    for index, (layer, k_pool, v_pool) in enumerate(zip(layers, keys, values)):
        w = {name: getattr(layer, name).to(dtype) for name in ("ln1", "wqkv", "wo", "ln2", "wgu", "wd")}
        qkv = linear(rms_norm(h, w["ln1"], eps), w["wqkv"], layer.bqkv)
        q = normed(qkv[:, :nq].reshape(m, nh, d), layer.qn)
        k = normed(qkv[:, nq:nq + nk].reshape(m, nkv, d), layer.kn)
        v = qkv[:, nq + nk:].reshape(m, nkv, d)
        if layer.cos is not None:
            q, k = rotary(q, layer.cos.to(dtype), layer.sin.to(dtype)), rotary(k, layer.cos.to(dtype), layer.sin.to(dtype))
        for j in range(nkv):
            k_pool[slots, j, writes] = k[:, j]
            v_pool[slots, j, writes] = v[:, j]
        att = torch.empty(m, nh, d, dtype=dtype)
        for r in range(m):
            seen = prefix[r] + count[r]
            visible = torch.ones(seen, dtype=torch.bool)
            visible[prefix[r]:] = allowed[r, :count[r]].bool()
            if layer.window:
                at = torch.tensor(list(range(prefix[r])) + [positions[first[r] + j] for j in range(count[r])])
                visible &= positions[r] - at < layer.window
            for j in range(nh):
                kv_head = j // group
                scores = (k_pool[slot[r], kv_head, :seen] @ q[r, j]) * scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=0)
                att[r, j] = weights @ v_pool[slot[r], kv_head, :seen]
        h = h + normed(linear(att.reshape(m, nq), w["wo"], layer.bo), layer.post_attn)
        gate, up = linear(rms_norm(h, w["ln2"], eps), w["wgu"], layer.bgu).chunk(2, dim=-1)
        h = h + normed(linear(ACTIVATIONS[act](gate) * up, w["wd"], layer.bd), layer.post_mlp)
        if index in taps:
            tapped[index] = h
    return h, rms_norm(h, norm.to(dtype), eps), keys, values, tapped
