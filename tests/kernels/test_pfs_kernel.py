"""PFS scoring and pruning: the path-product / threshold / budget kernel against its torch reference (exact
PFS and keep masks), and the pruner that runs it."""
from __future__ import annotations

import random

import pytest
import torch
from kernel_cases import DEVICE, random_parents

from mtpflow.kernels import pfs_prune, pfs_prune_reference, use_impl


def test_prune_kernel_matches_reference():
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    kept_some = pruned_some = False
    for case in range(16):
        n = rng.choice([0, 1, rng.randint(2, 48)])
        parents = torch.tensor(random_parents(rng, n), dtype=torch.long)
        probs = torch.rand(n, generator=g)
        if n and rng.random() < 0.3:
            probs[: n // 2] = 0.5  # equal scores: ties go to the lower node index
        threshold, budget = rng.choice([0.0, 0.05, 0.3]), rng.choice([None, 1, 4, 100])
        pfs, keep = pfs_prune_reference(probs, parents, threshold, budget)
        got_pfs, got_keep = pfs_prune(probs.to(DEVICE), parents, threshold, budget, impl="triton")
        assert torch.equal(got_pfs.cpu(), pfs) and torch.equal(got_keep.cpu(), keep), case
        kept_some |= bool(keep.any())
        pruned_some |= bool((~keep).any())
    assert kept_some and pruned_some


def test_reference_scores_are_path_products_and_respect_the_budget():
    parents = torch.tensor([-1, 0, 1, -1])
    pfs, keep = pfs_prune_reference(torch.tensor([0.5, 0.5, 0.5, 0.9]), parents, threshold=0.2, budget=2)
    assert torch.allclose(pfs, torch.tensor([0.5, 0.25, 0.125, 0.9]))
    assert keep.tolist() == [True, False, False, True]  # 0.25 passes the threshold but not the budget


def test_pfs_pruner_keeps_what_its_threshold_and_budget_rule_keeps():
    """PFSPruner now prunes through pfs_prune; with either implementation it keeps what its rule says: PFS over the
    threshold, at most max_nodes of them, best first, ties to the lower node index."""
    from mtpflow.strategies.pfs import PFSPruner, path_scores
    from mtpflow.types import Draft

    rng, g = random.Random(4), torch.Generator().manual_seed(4)
    for case in range(8):
        n = rng.randint(1, 30)
        parents = torch.tensor(random_parents(rng, n), dtype=torch.long)
        draft = Draft(torch.arange(n), parents, probs=torch.rand(n, generator=g))
        threshold, max_nodes = rng.choice([0.01, 0.1, 0.4]), rng.choice([0, 3, 16])
        pfs = path_scores(draft)
        order = sorted(range(n), key=lambda i: (-float(pfs[i]), i))[:max_nodes]
        expected = [bool(pfs[i] >= threshold) and i in order for i in range(n)]
        pruner = PFSPruner(threshold=threshold, adapt=0.0, max_nodes=max_nodes)
        for impl in ("torch", "triton"):
            with use_impl(impl):
                assert pruner.prune(None, draft).tolist() == expected, (case, impl)


def test_the_pruners_list_rule_keeps_what_the_reference_keeps():
    """On the CPU PFSPruner applies the threshold and budget over Python lists (pfs.threshold_and_budget): the same
    nodes as the torch reference keeps, float32 scores and tied ones included."""
    from mtpflow.kernels.pfs import keep_by_threshold_and_budget
    from mtpflow.strategies.pfs import threshold_and_budget

    rng, g = random.Random(7), torch.Generator().manual_seed(7)
    for case in range(400):
        n = rng.randint(1, 40)
        pfs = torch.rand(n, generator=g)
        if rng.random() < 0.4:
            pfs = torch.round(pfs * 4) / 4  # ties, and scores on the threshold itself
        threshold, budget = rng.choice([0.0, 0.05, 0.25, 0.35, 0.5, 0.9]), rng.choice([0, 1, 4, 12, 64])
        expected = keep_by_threshold_and_budget(pfs, threshold, budget).tolist()
        assert threshold_and_budget(pfs.tolist(), threshold, budget) == expected, (case, threshold, budget)
