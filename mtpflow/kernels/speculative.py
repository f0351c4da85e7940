"""Speculative sampling over a draft chain (Leviathan et al. 2023): accept draft token x at position i when
u_i * q_i(x) < p_i(x) (i.e. with probability min(1, p/q)), and at the first rejection sample the normalised
residual max(0, p - q); after a fully accepted chain sample the bonus token from p. A deterministic draft
(``draft_probs`` None) is the case q = one-hot of the drafted token: accept with probability p(x), and the
residual is p without x.

Randomness is passed in, never drawn here: ``uniforms`` [num_nodes + 1] float32 in [0, 1) (u_i tests node i,
the last one drives the final draw), so the reference and the kernel agree exactly. The final draw is an
inverse CDF over integer weights floor(prob * 2^40) (exact integer sums, so summation order cannot change the
token; the quantisation moves each probability by under 1e-12). A residual that is zero everywhere falls
back to p, as the gate does.
"""
from __future__ import annotations

import torch

from mtpflow.kernels.dispatch import resolve_impl

WEIGHT_SCALE = float(2**40)


def integer_weights(probs: torch.Tensor) -> torch.Tensor:
    """[..., vocab] float32 probabilities -> int64 weights floor(prob * 2^40) (the scaling is exact)."""
    return (probs.float() * WEIGHT_SCALE).to(torch.int64)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> int:
    """The first index whose cumulative weight exceeds floor(u * total) (float64 product, as in the kernel)."""
    total = weights.sum()
    threshold = torch.floor(uniform.double() * total.double()).to(torch.int64)
    return int((weights.cumsum(0) <= threshold).sum())


def draw(probs: torch.Tensor, uniform: torch.Tensor, fallback: torch.Tensor) -> int:
    """One token from ``probs`` [vocab] (any non-negative weights; normalising is not needed) by the inverse
    CDF at ``uniform``, or from ``fallback`` [vocab] when ``probs`` has no weight at all."""
    weights = integer_weights(probs)
    if int(weights.sum()) == 0:
        weights = integer_weights(fallback)
    return inverse_cdf(weights, uniform)


def residual(probs: torch.Tensor, draft_probs: torch.Tensor | None, token: int) -> torch.Tensor:
    """[vocab] max(0, p - q), unnormalised; q is one-hot of ``token`` when ``draft_probs`` is None (p without
    the drafted token)."""
    if draft_probs is None:
        out = probs.clone()
        out[token] = 0.0  # max(0, p - 1) at the drafted token, p elsewhere
        return out
    return (probs - draft_probs.float().to(probs.device)).clamp(min=0)


def speculative_accept_reference(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                                 tokens: torch.Tensor, uniforms: torch.Tensor) -> tuple[int, int, bool]:
    """(accepted prefix length, next token, whether it is a bonus token).

    target_probs: [num_nodes + 1, vocab] p after the root and after each node; draft_probs: [num_nodes, vocab]
    the q each draft token was drawn from, or None for a deterministic draft; tokens: [num_nodes];
    uniforms: [num_nodes + 1].
    """
    p = target_probs.float()
    u = uniforms.float().to(p.device)  # everything where the target's probabilities are (the gate's
    tokens = tokens.to(p.device)  # uniforms and the draft tokens usually come from the CPU)
    n = int(tokens.numel())
    rows = torch.arange(n, device=p.device)
    q_token = 1.0 if draft_probs is None else draft_probs.float().to(p.device)[rows, tokens]
    accept = u[:n] * q_token < p[rows, tokens]
    rejected = (~accept).nonzero().flatten()
    j = int(rejected[0]) if rejected.numel() else n
    if j == n:
        return n, draw(p[n], u[n], p[n]), True
    q_row = None if draft_probs is None else draft_probs[j]
    return j, draw(residual(p[j], q_row, int(tokens[j])), u[n], p[j]), False


def speculative_accept(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, tokens: torch.Tensor,
                       uniforms: torch.Tensor, impl: str | None = None) -> tuple[int, int, bool]:
    """Dispatcher for ``speculative_accept_reference`` (same arguments and result)."""
    if resolve_impl(impl, target_probs.device) == "torch":
        return speculative_accept_reference(target_probs, draft_probs, tokens, uniforms)
    from mtpflow.kernels.speculative_triton import speculative_accept_triton

    return speculative_accept_triton(target_probs, draft_probs, tokens, uniforms, WEIGHT_SCALE)
