"""Triton kernel for speculative accept / residual sampling over a chain: the acceptance tests for all nodes
at once, then two passes over the chosen row (total weight, then the inverse-CDF search) in one program."""
from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def speculative_accept_kernel(p_ptr, q_ptr, tokens_ptr, u_ptr, out_ptr, num_nodes, vocab, scale,
                              BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    nodes = tl.arange(0, BLOCK_N)
    valid = nodes < num_nodes
    x = tl.load(tokens_ptr + nodes, mask=valid, other=0)
    px = tl.load(p_ptr + nodes.to(tl.int64) * vocab + x, mask=valid, other=0.0)
    qx = tl.load(q_ptr + nodes.to(tl.int64) * vocab + x, mask=valid, other=0.0)
    u = tl.load(u_ptr + nodes, mask=valid, other=1.0)
    rejected = valid & ~(u * qx < px)
    j = tl.min(tl.where(rejected, nodes, num_nodes), axis=0)
    residual = j < num_nodes
    p_row = p_ptr + j.to(tl.int64) * vocab
    q_row = q_ptr + j.to(tl.int64) * vocab
    # pass 1: total residual weight and total p weight of row j (q is read only when a node was rejected)
    q_limit = tl.where(residual, vocab, 0)
    total_res = tl.zeros((), dtype=tl.int64)
    total_p = tl.zeros((), dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        m = offs < vocab
        p = tl.load(p_row + offs, mask=m, other=0.0)
        q = tl.load(q_row + offs, mask=offs < q_limit, other=0.0)
        total_res += tl.sum((tl.maximum(p - q, 0.0) * scale).to(tl.int64), axis=0)
        total_p += tl.sum((p * scale).to(tl.int64), axis=0)
    use_residual = residual & (total_res > 0)
    q_limit = tl.where(use_residual, vocab, 0)
    total = tl.where(use_residual, total_res, total_p)
    u_last = tl.load(u_ptr + num_nodes).to(tl.float64)
    threshold = tl.floor(u_last * total.to(tl.float64)).to(tl.int64)
    # pass 2: count indices whose inclusive prefix weight is <= threshold
    prefix = tl.zeros((), dtype=tl.int64)
    count = tl.zeros((), dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        m = offs < vocab
        p = tl.load(p_row + offs, mask=m, other=0.0)
        q = tl.load(q_row + offs, mask=offs < q_limit, other=0.0)
        w = (tl.maximum(p - q, 0.0) * scale).to(tl.int64)
        w = tl.where(m, w, 0)
        inclusive = prefix + tl.cumsum(w, axis=0)
        count += tl.sum((m & (inclusive <= threshold)).to(tl.int64), axis=0)
        prefix += tl.sum(w, axis=0)
    tl.store(out_ptr, j.to(tl.int64))
    tl.store(out_ptr + 1, count)


def speculative_accept_triton(target_probs: torch.Tensor, draft_probs: torch.Tensor, tokens: torch.Tensor,
                              uniforms: torch.Tensor, weight_scale: float) -> tuple[int, int, bool]:
    """Same contract as ``speculative.speculative_accept_reference``; ``weight_scale``: its ``WEIGHT_SCALE``
    (passed in: the kernel module imports nothing of the dispatcher above it)."""
    dev = target_probs.device
    p = target_probs.float().contiguous()
    n = int(tokens.numel())
    vocab = p.shape[-1]
    q = draft_probs.float().to(dev).contiguous() if n else p  # never read when there are no nodes
    out = torch.zeros(2, dtype=torch.long, device=dev)
    speculative_accept_kernel[(1,)](
        p, q, tokens.to(dev).contiguous(), uniforms.float().to(dev).contiguous(), out, n, vocab, weight_scale,
        BLOCK_N=max(16, triton.next_power_of_2(max(n, 1))), BLOCK_V=min(1024, max(16, triton.next_power_of_2(vocab))),
    )
    j, token = out.tolist()
    return j, token, j == n
