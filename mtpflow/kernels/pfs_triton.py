"""Triton kernel for PFS scoring and pruning: one program that multiplies the probabilities down the tree
(the same float32 multiplies as the reference, repeated until nothing changes), applies the threshold and
ranks the survivors for the budget."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
