"""The prompt-lookup n-gram match: the Triton kernel against the reference loop, and PLD's
``find_ngram_continuation`` through the dispatcher."""
from __future__ import annotations

import random

import torch
from kernel_cases import DEVICE

from mtpflow.kernels import ngram_continuation, ngram_continuation_reference
from mtpflow.strategies.pld import find_ngram_continuation


def _cases(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        length = rng.choice([0, 1, 2, rng.randint(3, 80)])
        vocab = rng.choice([1, 2, 3, 5, 50])
        context = torch.tensor([rng.randrange(vocab) for _ in range(length)], dtype=torch.long)
        min_n = rng.randint(1, 4)
        yield context, min_n, rng.randint(min_n, 6), rng.randint(0, 9)


def test_kernel_equals_reference():
    for context, min_n, max_n, k in _cases(1, 40):
        expected = ngram_continuation_reference(context, min_n, max_n, k)
        assert torch.equal(ngram_continuation(context.to(DEVICE), min_n, max_n, k, impl="triton").cpu(), expected)


def test_kernel_on_a_long_history_spans_several_programs():
    rng = random.Random(2)
    context = torch.tensor([rng.randrange(4) for _ in range(700)], dtype=torch.long)
    for max_n in (1, 3, 8):
        expected = ngram_continuation_reference(context, 1, max_n, 5)
        assert expected.numel()
        assert torch.equal(ngram_continuation(context.to(DEVICE), 1, max_n, 5, impl="triton").cpu(), expected)


def test_pld_uses_the_dispatcher_with_identical_results():
    for context, min_n, max_n, k in _cases(3, 100):
        assert torch.equal(find_ngram_continuation(context, min_n, max_n, k),
                           ngram_continuation_reference(context, min_n, max_n, k))


def test_every_match_reports_the_references_n_and_continuation():
    from mtpflow.kernels import ngram_match, ngram_match_reference

    cases = list(_cases(5, 600))
    # tokens whose 8 bytes overlap when shifted: a substring hit across token boundaries is no match
    cases.append((torch.tensor([1 << 56, 1, 1 << 8, 5, 1 << 8, 1], dtype=torch.long), 1, 3, 3))
    cases.append((torch.tensor([7, 1 << 8, 0, 1, 7, 1 << 8], dtype=torch.long), 1, 2, 2))
    for i, (context, min_n, max_n, k) in enumerate(cases):
        n, expected = ngram_match_reference(context, min_n, max_n, k)
        assert torch.equal(expected, ngram_continuation_reference(context, min_n, max_n, k))
        # the n it reports is the longest with a match: the loop over that n alone finds the same
        by_n = next((m for m in range(max_n, min_n - 1, -1)
                     if ngram_continuation_reference(context, m, m, k).numel()), None)
        assert n == by_n
        impls = ["torch"] + (["triton"] if i % 10 == 0 else [])  # the interpreter is slow: every tenth case
        for impl in impls:
            got_n, follow = ngram_match(context.to(DEVICE), min_n, max_n, k, impl=impl)
            assert got_n == n and torch.equal(follow.cpu(), expected) and follow.dtype == expected.dtype, impl
