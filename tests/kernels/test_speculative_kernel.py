"""Speculative accept / residual sampling: the Triton kernel against the reference given the same uniforms
(exact), and the reference's output distribution equal to the target's (the lossless property)."""
from __future__ import annotations

import random

import torch
from kernel_cases import DEVICE

from mtpflow.kernels import speculative_accept, speculative_accept_reference
from mtpflow.kernels.speculative import integer_weights, inverse_cdf


def test_kernel_matches_reference_given_the_same_uniforms():
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    outcomes = set()
    for case in range(32):
        n = rng.choice([0, 1, rng.randint(2, 8)])
        vocab = rng.choice([2, 5, rng.randint(6, 3000)])
        p = (torch.randn(n + 1, vocab, generator=g) * rng.choice([0.5, 3.0])).softmax(-1)
        q = (torch.randn(n, vocab, generator=g) * 3.0).softmax(-1)
        if n and rng.random() < 0.3:
            q[0] = p[0]  # zero residual: falls back to p
        tokens = torch.multinomial(q, 1, generator=g).flatten() if n else torch.zeros(0, dtype=torch.long)
        uniforms = torch.rand(n + 1, generator=g)
        q = q if case % 2 else None  # odd cases: draft distributions; even: a deterministic draft (one-hot q)
        expected = speculative_accept_reference(p, q, tokens, uniforms)
        on_device = [None if t is None else t.to(DEVICE) for t in (p, q, tokens, uniforms)]
        assert speculative_accept(*on_device, impl="triton") == expected, case
        outcomes.add((q is None, expected[0] == n, expected[0] == 0))
    assert len(outcomes) >= 4  # full accepts and early rejections, with and without draft distributions


def test_inverse_cdf_picks_by_integer_weight():
    weights = integer_weights(torch.tensor([0.25, 0.0, 0.75]))
    assert inverse_cdf(weights, torch.tensor(0.0)) == 0
    assert inverse_cdf(weights, torch.tensor(0.2499)) == 0
    assert inverse_cdf(weights, torch.tensor(0.25)) == 2  # the zero-weight token is never drawn
    assert inverse_cdf(weights, torch.tensor(0.9999)) == 2


def test_first_token_follows_the_target_distribution():
    """Draft from q, accept/reject against p: the first emitted token must be distributed as p[0]."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    trials = 6000
    counts = torch.zeros(4)
    for _ in range(trials):
        token = torch.multinomial(q[0], 1, generator=g)
        accepted, next_token, _ = speculative_accept_reference(p, q, token, torch.rand(2, generator=g))
        counts[int(token) if accepted else next_token] += 1
    freq = counts / trials
    assert torch.allclose(freq, p[0], atol=0.025), freq  # ~4 standard errors; q alone would be far off
