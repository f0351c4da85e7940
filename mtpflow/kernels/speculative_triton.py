"""Triton kernel for speculative accept / residual sampling over a chain: the acceptance tests for all nodes
at once, then two passes over the chosen row (total weight, then the inverse-CDF search) in one program."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_block(p_row, q_row, offs, vocab, q_limit, drafted, scale, HAS_Q: tl.constexpr):
    """One block of the chosen row: (p's integer weights, max(0, p - q)'s integer weights). q is read below
    ``q_limit`` only (0: no residual, q counts as zero); without draft distributions q is one-hot of
    ``drafted``."""
    m = offs < vocab
    p = tl.load(p_row + offs, mask=m, other=0.0)
    if HAS_Q:
        q = tl.load(q_row + offs, mask=offs < q_limit, other=0.0)
    else:
        q = tl.where((offs == drafted) & (offs < q_limit), 1.0, 0.0)
    w_p = tl.where(m, (p * scale).to(tl.int64), 0)
    w_res = tl.where(m, (tl.maximum(p - q, 0.0) * scale).to(tl.int64), 0)
    return w_p, w_res


@triton.jit
def speculative_accept_kernel(p_ptr, q_ptr, tokens_ptr, u_ptr, out_ptr, num_nodes, vocab, scale,
                              HAS_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    nodes = tl.arange(0, BLOCK_N)
    valid = nodes < num_nodes
    x = tl.load(tokens_ptr + nodes, mask=valid, other=0)
    px = tl.load(p_ptr + nodes.to(tl.int64) * vocab + x, mask=valid, other=0.0)
    if HAS_Q:
        qx = tl.load(q_ptr + nodes.to(tl.int64) * vocab + x, mask=valid, other=0.0)
    else:
        qx = tl.where(valid, 1.0, 0.0)
    u = tl.load(u_ptr + nodes, mask=valid, other=1.0)
    rejected = valid & ~(u * qx < px)
    j = tl.min(tl.where(rejected, nodes, num_nodes), axis=0)
    residual = j < num_nodes
    drafted = tl.load(tokens_ptr + j, mask=residual, other=-1)
    p_row = p_ptr + j.to(tl.int64) * vocab
    q_row = q_ptr + j.to(tl.int64) * vocab
    # pass 1: total residual weight and total p weight of row j (q is read only when a node was rejected)
    q_limit = tl.where(residual, vocab, 0)
    total_res = tl.zeros((), dtype=tl.int64)
    total_p = tl.zeros((), dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        w_p, w_res = _row_block(p_row, q_row, start + tl.arange(0, BLOCK_V), vocab, q_limit, drafted, scale, HAS_Q)
        total_res += tl.sum(w_res, axis=0)
        total_p += tl.sum(w_p, axis=0)
    use_residual = residual & (total_res > 0)
    q_limit = tl.where(use_residual, vocab, 0)  # q zero: the residual weights are p's
    total = tl.where(use_residual, total_res, total_p)
    u_last = tl.load(u_ptr + num_nodes).to(tl.float64)
    threshold = tl.floor(u_last * total.to(tl.float64)).to(tl.int64)
    # pass 2: count indices whose inclusive prefix weight is <= threshold
    prefix = tl.zeros((), dtype=tl.int64)
    count = tl.zeros((), dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        _, w = _row_block(p_row, q_row, offs, vocab, q_limit, drafted, scale, HAS_Q)
        inclusive = prefix + tl.cumsum(w, axis=0)
        count += tl.sum(((offs < vocab) & (inclusive <= threshold)).to(tl.int64), axis=0)
        prefix += tl.sum(w, axis=0)
    tl.store(out_ptr, j.to(tl.int64))
    tl.store(out_ptr + 1, count)


def speculative_accept_triton(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, tokens: torch.Tensor,
                              uniforms: torch.Tensor, weight_scale: float) -> tuple[int, int, bool]:
    """Same contract as ``speculative.speculative_accept_reference``; ``weight_scale``: its ``WEIGHT_SCALE``
    (passed in: the kernel module imports nothing of the dispatcher above it)."""
    dev = target_probs.device
    p = target_probs.float().contiguous()
    n = int(tokens.numel())
    vocab = p.shape[-1]
    has_q = draft_probs is not None and n > 0
    q = draft_probs.float().to(dev).contiguous() if has_q else p  # never read without draft distributions
    out = torch.zeros(2, dtype=torch.long, device=dev)
    speculative_accept_kernel[(1,)](
        p, q, tokens.to(dev).contiguous(), uniforms.float().to(dev).contiguous(), out, n, vocab, weight_scale,
        HAS_Q=has_q, BLOCK_N=max(16, triton.next_power_of_2(max(n, 1))),
        BLOCK_V=min(1024, max(16, triton.next_power_of_2(vocab))),
    )
    j, token = out.tolist()
    return j, token, j == n
