"""Grafting drafters' trees into a host draft (mtpflow/strategies/graft.py): the union from the root, the scores it
carries, and several trees over lists (GraftedTree) giving what graft_tree gives one tree at a time."""
import random

import pytest
import torch

from mtpflow.strategies.graft import GraftedTree, graft_tree
from mtpflow.types import Draft


def host_draft(dists=False) -> Draft:
    # root -> 10 (node 0) -> 11 (node 1); root -> 20 (node 2)
    return Draft(torch.tensor([10, 11, 20]), torch.tensor([-1, 0, -1]), probs=torch.tensor([0.5, 0.5, 0.25]),
                 dists=torch.full((3, 32), 1 / 32) if dists else None, source="heads",
                 scores={"pfs": torch.tensor([0.5, 0.25, 0.25]), "entropy": torch.tensor([0.1, 0.2, 0.3])})


def test_a_tree_is_merged_from_the_root():
    # grafted: 10 (shared with node 0) -> 12 (new), 10 -> 11 (shared with node 1), root -> 30 (new)
    out = graft_tree(host_draft(), [10, 12, 11, 30], [-1, 0, 0, -1], [0.8, 0.4, 0.1, 0.05], "lookup",
                     extra={"rank": [1.0, 2.0, 3.0, 4.0]})
    assert out.tokens.tolist() == [10, 11, 20, 12, 30]
    assert out.parents.tolist() == [-1, 0, -1, 0, -1]
    scores = {key: value.tolist() for key, value in out.scores.items()}
    assert scores["pfs"] == pytest.approx([0.8, 0.25, 0.25, 0.4, 0.05])  # a shared node keeps the larger score
    assert scores["lookup"] == [1.0, 1.0, 0.0, 1.0, 1.0]  # every node of the grafted tree
    assert scores["grafted"] == [0.0, 0.0, 0.0, 1.0, 1.0]  # the nodes it added
    assert scores["calibrated"] == scores["lookup"]
    assert scores["rank"] == [1.0, 3.0, 0.0, 2.0, 4.0]
    # a new node's entropy: its first sibling's (12 under node 0: node 1's; 30 under the root: node 0's)
    assert scores["entropy"] == pytest.approx([0.1, 0.2, 0.3, 0.2, 0.1])
    assert out.probs.tolist() == pytest.approx([0.5, 0.5, 0.25, 0.5, 0.05])  # own: pfs / its grafted parent's
    assert out.source == "heads"


def test_a_stochastic_host_gets_point_masses_for_new_nodes():
    out = graft_tree(host_draft(dists=True), [7], [-1], [0.3], "suffix", calibrated=False)
    assert out.dists[3].tolist() == [float(i == 7) for i in range(32)]
    assert out.scores["calibrated"].tolist() == [0.0] * 4


def test_an_empty_host_takes_the_first_trees_mark_and_an_empty_tree_changes_nothing():
    empty = Draft.empty("heads")
    assert graft_tree(empty, [], [], [], "lookup") is empty
    merged = GraftedTree.of_draft(empty)
    merged.add([], [], [], "lookup")
    assert merged.draft() is empty
    merged.add([5, 6], [-1, 0], [0.5, 0.25], "suffix")
    merged.add([5], [-1], [0.9], "recycled")
    out = merged.draft()
    assert out.source == "suffix" and out.tokens.tolist() == [5, 6]
    assert out.scores["pfs"].tolist() == pytest.approx([0.9, 0.25])


def random_tree(rng, n, vocab):
    return [rng.randrange(vocab) for _ in range(n)], [rng.randrange(-1, i) if i else -1 for i in range(n)]


def test_several_trees_over_lists_equal_grafting_one_at_a_time():
    rng = random.Random(0)
    for _ in range(300):
        vocab, n = rng.choice([3, 5, 50]), rng.randrange(0, 10)
        tokens, parents = random_tree(rng, n, vocab)
        scores = {"entropy": torch.rand(n)} if rng.random() < 0.7 else {}
        if rng.random() < 0.5:
            scores["pfs"] = torch.rand(n)
        host = Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     probs=torch.rand(n) if rng.random() < 0.8 else None,
                     dists=torch.rand(n, vocab) if rng.random() < 0.2 else None, source="host", scores=scores)
        grafts = []
        for g in range(rng.randrange(1, 4)):
            m = rng.randrange(0, 8)
            gt, gp = random_tree(rng, m, vocab)
            grafts.append((gt, gp, [rng.random() for _ in range(m)], rng.choice(["recycled", "suffix"]),
                           {f"x{g}": [rng.random() for _ in range(m)]} if rng.random() < 0.5 else None,
                           rng.random() < 0.7))
        one_at_a_time, merged = host, GraftedTree.of_draft(host)
        for gt, gp, pfs, mark, extra, calibrated in grafts:
            one_at_a_time = graft_tree(one_at_a_time, gt, gp, pfs, mark, extra=extra, calibrated=calibrated)
            merged.add(gt, gp, pfs, mark, extra=extra, calibrated=calibrated)
        out = merged.draft()
        assert out.tokens.tolist() == one_at_a_time.tokens.tolist()
        assert out.parents.tolist() == one_at_a_time.parents.tolist()
        assert out.source == one_at_a_time.source
        assert list(out.scores) == list(one_at_a_time.scores)
        for key, value in out.scores.items():
            assert torch.equal(value, one_at_a_time.scores[key]), key
        for a, b in ((out.probs, one_at_a_time.probs), (out.dists, one_at_a_time.dists)):
            assert (a is None and b is None) or torch.equal(a, b)
