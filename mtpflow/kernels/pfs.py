"""PFS (path feasibility score) scoring and pruning of a draft tree: the product of draft probabilities along
each root-to-node path, then keep the nodes whose PFS is at least the threshold, at most ``budget`` of them
(highest PFS first, ties to the lower node index, so a parent always ranks before its children).
``pfs_prune`` works on a tree whose per-node probabilities are known (the pruner's hot path).
"""
from __future__ import annotations

import torch

from mtpflow.kernels.dispatch import resolve_impl


def path_products(node_probs: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[num_nodes] float32 PFS, multiplied from the root down (parent's PFS * own probability): one float32
    multiply per node in depth order, which the kernel repeats exactly."""
    probs = node_probs.float()
    par = parents.to(probs.device)
    has_parent = par >= 0
    gather_from = par.clamp(min=0)
    pfs = probs.clone()
    for _ in range(int(node_depths(parents).max()) - 1 if parents.numel() else 0):
        pfs = torch.where(has_parent, pfs[gather_from] * probs, probs)
    return pfs


def keep_by_threshold_and_budget(pfs: torch.Tensor, threshold: float, budget: int | None) -> torch.Tensor:
    """[num_nodes] bool: PFS >= threshold and among the ``budget`` best (PFS desc, index asc)."""
    n = int(pfs.numel())
    order = torch.sort(pfs, descending=True, stable=True).indices
    rank = torch.empty(n, dtype=torch.long, device=pfs.device)
    rank[order] = torch.arange(n, device=pfs.device)
    limit = n if budget is None else int(budget)
    return (pfs >= torch.tensor(threshold, dtype=torch.float32, device=pfs.device)) & (rank < limit)


def pfs_prune_reference(node_probs: torch.Tensor, parents: torch.Tensor, threshold: float,
                        budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pfs [num_nodes] float32, keep [num_nodes] bool) for a draft tree in topological order."""
    pfs = path_products(node_probs, parents)
    return pfs, keep_by_threshold_and_budget(pfs, threshold, budget)


def pfs_prune(node_probs: torch.Tensor, parents: torch.Tensor, threshold: float, budget: int | None = None,
              impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher for ``pfs_prune_reference`` (same arguments and result)."""
    if resolve_impl(impl, node_probs.device) == "torch":
        return pfs_prune_reference(node_probs, parents, threshold, budget)
    from mtpflow.kernels.pfs_triton import pfs_prune_triton

    return pfs_prune_triton(node_probs, parents, threshold, budget)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[num_nodes] depth of each node (1 for children of the root), parents in topological order."""
    depth: list[int] = []
    for p in parents.tolist():
        depth.append(1 if p < 0 else depth[p] + 1)
    return torch.tensor(depth, dtype=torch.long)
