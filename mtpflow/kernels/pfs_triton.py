"""Triton kernels for PFS scoring and pruning: per draft position a softmax and a top-k (k selection
passes over the vocabulary, ties to the lower id), then one program that multiplies the probabilities down
the tree (the same float32 multiplies as the reference, repeated until nothing changes), applies the threshold
and ranks the survivors for the budget."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def softmax_topk_kernel(logits_ptr, probs_ptr, tokens_ptr, vocab, row_stride, K: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * row_stride
    row_max = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        row_max = tl.maximum(row_max, tl.max(tl.load(base + offs, mask=offs < vocab, other=float("-inf")), axis=0))
    denom = tl.zeros((), dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        denom += tl.sum(tl.exp(x - row_max), axis=0)
    prev_val = tl.full((), float("inf"), tl.float32)
    prev_idx = tl.full((), -1, tl.int32)
    for j in tl.static_range(K):
        best_val = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.full((), vocab, tl.int32)
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            # only entries after the previous pick in (value desc, index asc) order
            after = (x < prev_val) | ((x == prev_val) & (offs > prev_idx))
            x = tl.where(after & (offs < vocab), x, float("-inf"))
            m = tl.max(x, axis=0)
            i = tl.min(tl.where((x == m) & after & (offs < vocab), offs, vocab), axis=0)
            better = (m > best_val) | ((m == best_val) & (i < best_idx))
            best_val = tl.where(better, m, best_val)
            best_idx = tl.where(better, i, best_idx)
        tl.store(probs_ptr + row * K + j, tl.exp(best_val - row_max) / denom)
        tl.store(tokens_ptr + row * K + j, best_idx.to(tl.int64))
        prev_val = best_val
        prev_idx = best_idx


@triton.jit
def pfs_prune_kernel(probs_ptr, parents_ptr, pfs_ptr, keep_ptr, num_nodes, threshold, budget,
                     BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    valid = idx < num_nodes
    prob = tl.load(probs_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    parent = tl.load(parents_ptr + idx, mask=valid, other=-1).to(tl.int32)
    onehot = parent[:, None] == idx[None, :]
    pfs = prob
    changed = num_nodes
    rounds = 0
    while (changed > 0) & (rounds < num_nodes + 1):  # a node is final once its parent is: depth rounds
        from_parent = tl.sum(tl.where(onehot, pfs[None, :], 0.0), axis=1)  # exactly one term: exact
        new = tl.where(parent >= 0, from_parent * prob, prob)
        changed = tl.sum((new != pfs).to(tl.int32), axis=0)
        pfs = new
        rounds += 1
    ahead = ((pfs[None, :] > pfs[:, None]) | ((pfs[None, :] == pfs[:, None]) & (idx[None, :] < idx[:, None])))
    rank = tl.sum((ahead & valid[None, :]).to(tl.int32), axis=1)
    keep = valid & (pfs >= threshold) & (rank < budget)
    tl.store(pfs_ptr + idx, pfs, mask=valid)
    tl.store(keep_ptr + idx, keep.to(tl.int8), mask=valid)


def _prune(node_probs: torch.Tensor, parents: torch.Tensor, threshold: float, budget: int | None):
    n = int(node_probs.numel())
    dev = node_probs.device
    pfs = torch.empty(n, dtype=torch.float32, device=dev)
    keep = torch.empty(n, dtype=torch.int8, device=dev)
    if n:
        pfs_prune_kernel[(1,)](node_probs.float().contiguous(), parents.to(dev).contiguous(), pfs, keep, n,
                               float(threshold), n if budget is None else int(budget),
                               BLOCK=max(16, triton.next_power_of_2(n)))
    return pfs, keep.bool()


def pfs_prune_triton(node_probs, parents, threshold, budget):
    """Same contract as ``pfs.pfs_prune_reference``."""
    return _prune(node_probs, parents, threshold, budget)


def pfs_tree_triton(draft_logits, parents, choices, threshold, budget, depths):
    """Same contract as ``pfs.pfs_tree_reference``; ``depths``: ``pfs.template_depths(parents)`` (passed in: the
    kernel module imports nothing of the dispatcher above it)."""
    dev = draft_logits.device
    logits = draft_logits.float().contiguous()
    positions, vocab = logits.shape
    k = int(choices.max()) + 1 if choices.numel() else 1
    probs = torch.empty(positions, k, dtype=torch.float32, device=dev)
    tokens = torch.empty(positions, k, dtype=torch.long, device=dev)
    softmax_topk_kernel[(positions,)](logits, probs, tokens, vocab, logits.stride(0), K=k,
                                      BLOCK_V=min(1024, max(16, triton.next_power_of_2(vocab))))
    rows = (depths - 1).to(dev)
    cols = choices.to(dev)
    pfs, keep = _prune(probs[rows, cols], parents, threshold, budget)
    return tokens[rows, cols], pfs, keep
