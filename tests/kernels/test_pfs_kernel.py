"""PFS scoring and pruning: the path-product / threshold / budget kernel and the fused softmax + top-k tree
kernel against their torch references (exact tokens and keep masks; PFS equal)."""
from __future__ import annotations

import random

import torch
from kernel_cases import DEVICE, random_parents

from mtpflow.kernels import pfs_prune, pfs_prune_reference, pfs_tree, pfs_tree_reference, use_backend


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
        got_pfs, got_keep = pfs_prune(probs.to(DEVICE), parents, threshold, budget, backend="triton")
        assert torch.equal(got_pfs.cpu(), pfs) and torch.equal(got_keep.cpu(), keep), case
        kept_some |= bool(keep.any())
        pruned_some |= bool((~keep).any())
    assert kept_some and pruned_some


def test_reference_scores_are_path_products_and_respect_the_budget():
    parents = torch.tensor([-1, 0, 1, -1])
    pfs, keep = pfs_prune_reference(torch.tensor([0.5, 0.5, 0.5, 0.9]), parents, threshold=0.2, budget=2)
    assert torch.allclose(pfs, torch.tensor([0.5, 0.25, 0.125, 0.9]))
    assert keep.tolist() == [True, False, False, True]  # 0.25 passes the threshold but not the budget


def _template(rng: random.Random, depth: int, k: int):
    parents, choices, depths = [], [], []
    for i in range(rng.randint(1, 24)):
        p = rng.randint(-1, i - 1)
        while p >= 0 and depths[p] >= depth:
            p = parents[p]
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
        choices.append(rng.randrange(k))
    return torch.tensor(parents), torch.tensor(choices)


def test_fused_topk_tree_kernel_matches_reference():
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    for case in range(10):
        depth, vocab, k = rng.randint(1, 4), rng.choice([4, rng.randint(5, 2000)]), rng.randint(1, 4)
        parents, choices = _template(rng, depth, k)
        logits = torch.randn(depth, vocab, generator=g) * 3
        if rng.random() < 0.3:
            logits = logits.round()  # tied logits: the lower token id ranks first
        threshold, budget = rng.choice([0.0, 0.01, 0.2]), rng.choice([None, 3, 50])
        tokens, pfs, keep = pfs_tree_reference(logits, parents, choices, threshold, budget)
        got = pfs_tree(logits.to(DEVICE), parents, choices, threshold, budget, backend="triton")
        got_tokens, got_pfs, got_keep = (t.cpu() for t in got)
        assert torch.equal(got_tokens, tokens), case
        torch.testing.assert_close(got_pfs, pfs, rtol=1e-5, atol=1e-7)
        assert torch.equal(got_keep, keep), case


def test_pfs_pruner_keeps_what_its_threshold_and_budget_rule_keeps():
    """PFSPruner now prunes through pfs_prune; with either backend it keeps what its rule says: PFS over the
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
        for backend in ("torch", "triton"):
            with use_backend(backend):
                assert pruner.prune(None, draft).tolist() == expected, (case, backend)
