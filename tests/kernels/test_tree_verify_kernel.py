"""The greedy tree verify kernel (the accepted path from the argmax rows) against the torch reference: exact outputs
over random trees, vocab sizes and match rates, duplicate siblings and empty drafts included."""
from __future__ import annotations

import random

import pytest
import torch
from kernel_cases import DEVICE, random_parents

from mtpflow.kernels import greedy_tree_verify, greedy_tree_verify_reference


def _case(rng: random.Random, g: torch.Generator):
    n = rng.choice([0, 1, 2, rng.randint(3, 40)])
    vocab = rng.choice([2, 7, rng.randint(8, 3000)])
    parents = random_parents(rng, n)
    logits = torch.randn(n + 1, vocab, generator=g)
    if rng.random() < 0.3:
        logits = logits.round()  # ties: the first maximal index wins, as in torch.argmax
    argmax = logits.argmax(-1)
    hit = rng.random()
    tokens = [int(argmax[p + 1]) if rng.random() < hit else rng.randrange(vocab) for p in parents]
    return argmax, torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)


def _same(a, b):
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_kernel_matches_reference_on_random_trees():
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    accepted_somewhere = False
    for case in range(24):
        argmax, tokens, parents = _case(rng, g)
        ref = greedy_tree_verify_reference(argmax, tokens, parents)
        accepted_somewhere |= ref[0].numel() > 1
        assert _same(greedy_tree_verify(argmax.to(DEVICE), tokens, parents, impl="triton"), ref), case
    assert accepted_somewhere  # the cases exercise long accepted paths, not only immediate rejections


def test_duplicate_siblings_take_the_first_match_like_the_reference():
    # nodes 0 and 1 are both the target's choice; only node 1 has an accepted child
    argmax = torch.tensor([5, 9, 9, 4])
    tokens = torch.tensor([5, 5, 9])
    parents = torch.tensor([-1, -1, 1])
    ref = greedy_tree_verify_reference(argmax, tokens, parents)
    assert ref[0].tolist() == [0] and ref[1] == 9 and ref[2] is True
    assert _same(greedy_tree_verify(argmax.to(DEVICE), tokens, parents, impl="triton"), ref)


def test_torch_impl_is_the_reference():
    argmax = torch.tensor([3, 1, 2])
    out = greedy_tree_verify(argmax, torch.tensor([3, 1]), torch.tensor([-1, 0]), impl="torch")
    assert out[0].tolist() == [0, 1] and out[1:] == (2, True)


@pytest.mark.parametrize("impl", ["torch", None])
def test_an_empty_draft_gives_the_references_answer(impl):
    argmax, empty = torch.tensor([7]), torch.zeros(0, dtype=torch.long)
    out, ref = greedy_tree_verify(argmax, empty, empty, impl=impl), greedy_tree_verify_reference(argmax, empty, empty)
    assert out[0].tolist() == ref[0].tolist() == [] and out[1:] == ref[1:] == (7, False)
