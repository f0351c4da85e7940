"""Acceptance gates: greedy exact match (lossless), speculative sampling (lossless in distribution, Leviathan
et al. 2023, with recursive rejection over tree siblings) and typical acceptance (lossy, Medusa style)."""
from __future__ import annotations

import math
from typing import Callable

import torch

from mtpflow.errors import check_range
from mtpflow.hookspecs import hookimpl
from mtpflow.kernels import children_lists, greedy_tree_verify, speculative_accept
from mtpflow.kernels.speculative import draw, residual
from mtpflow.sampling import target_probs
from mtpflow.types import BONUS, RECOVERED, Decision, DecodeState, Draft, Verification


class GreedyGate:
    """Accept while the draft token equals the target's argmax; lossless for greedy decoding."""

    reads_only_target_argmax = True  # under greedy decoding (sampling hands over to SpeculativeSamplingGate)

    @hookimpl
    def gate(self, state: DecodeState, draft: Draft, verification: Verification) -> Decision:
        if not state.sampling.greedy:
            return SpeculativeSamplingGate().gate(state, draft, verification)
        path, next_token, leaf = greedy_tree_verify(verification.target_argmax(), draft.tokens, draft.parents)
        return Decision(accepted=path, next_token=next_token, next_kind=BONUS if leaf else RECOVERED)


class SpeculativeSamplingGate:
    """Speculative sampling: the emitted tokens follow exactly the target distribution.

    A chain node drawn from a stochastic proposer (``draft.dists`` set) is accepted with min(1, p/q) and a
    rejection samples the residual max(0, p - q). Deterministic drafts and tree siblings use the
    without-replacement rule: accept token x with probability p(x), else zero p(x), renormalise and try the
    next sibling; after the last sibling sample from what is left. Both keep the output distribution p.
    A chain goes through ``speculative_accept`` in one call (on a GPU the Triton kernel, one host read); a
    tree takes ``speculative_tree_walk``. Both read the same uniforms, drawn from the run's generator.
    """

    @hookimpl
    def gate(self, state: DecodeState, draft: Draft, verification: Verification) -> Decision:
        probs = target_probs(verification.logits, state.sampling)  # [1 + num_nodes, vocab], the logits' device
        uniforms = torch.rand(draft.num_nodes + 1, generator=state.extras.get("rng"))  # [num_nodes + 1], CPU
        if draft.is_chain:
            accepted, next_token, bonus = speculative_accept(probs, draft.dists, draft.tokens, uniforms)
            path = list(range(accepted))
        else:
            rows: dict[int, torch.Tensor] = {}

            def row_probs(i: int) -> torch.Tensor:
                """Row ``i`` of ``probs`` on the CPU: the walk reads single entries, which on a GPU would each
                be a host sync; only the rows the walk visits are copied."""
                if i not in rows:
                    rows[i] = probs[i].cpu()
                return rows[i]

            path, next_token, bonus = speculative_tree_walk(row_probs, draft, uniforms)
        return Decision(torch.tensor(path, dtype=torch.long), next_token, BONUS if bonus and path else RECOVERED)


def speculative_tree_walk(row_probs: Callable[[int], torch.Tensor], draft: Draft,
                          uniforms: torch.Tensor) -> tuple[list[int], int, bool]:
    """(accepted path, next token, whether the path ended on a leaf) for any draft tree, node by node in
    Python (the contract of ``speculative_accept``, for trees).

    ``row_probs(i)``: the target's probabilities [vocab] after row ``i`` (0: the root, i + 1: node i), float32.
    ``uniforms`` [num_nodes + 1]: node ``c`` is tested with ``uniforms[c]`` and the final draw takes the last
    one, as in ``speculative_accept``, so on a chain both give the same path and token for the same uniforms.
    A node is accepted when u * q(x) < p(x) (float32, as the kernel compares); q is the node's draft
    distribution when it is its parent's only child and ``draft.dists`` is set, else one-hot of its token.
    """
    toks = draft.tokens.tolist()
    root, kids = children_lists(draft.parents.tolist())
    path: list[int] = []
    row, options = 0, root
    while options:
        p = row_probs(row)
        chosen = None
        for i, c in enumerate(options):
            x = toks[c]
            q = draft.dists[c].float().to(p.device) if draft.dists is not None and len(options) == 1 else None
            if bool(uniforms[c] * (1.0 if q is None else q[x]) < p[x]):
                chosen = c
                break
            p = residual(p, q, x)
            if i + 1 < len(options):  # the next sibling is tested against what is left, renormalised
                total = float(p.sum())
                if total <= 0:
                    break
                p = p / total
        if chosen is None:
            return path, draw(p, uniforms[-1], row_probs(row)), False
        path.append(chosen)
        row, options = chosen + 1, kids[chosen]
    return path, draw(row_probs(row), uniforms[-1], row_probs(row)), True


class TypicalGate:
    """Typical acceptance (Medusa): accept draft token x if p(x) > min(epsilon, delta * exp(-H(p))).

    Lossy: it may accept tokens the target would not have chosen; the run records the error propagation rate.
    """

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3, temperature: float = 1.0):
        self.epsilon = check_range("gate.epsilon", epsilon, 0, 1)
        self.delta = check_range("gate.delta", delta, 0, None)
        self.temperature = check_range("gate.temperature", temperature, 0, None, low_inclusive=False)

    @hookimpl
    def gate(self, state: DecodeState, draft: Draft, verification: Verification) -> Decision:
        temperature = state.sampling.temperature or self.temperature
        probs = (verification.logits.float() / temperature).softmax(-1)
        entropy = -(probs * probs.clamp(min=1e-20).log()).sum(-1)  # [1 + num_nodes]
        threshold = torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)
        # each node's probability under its parent's row, gathered where the logits live and read on the CPU
        # in one copy (the walk below reads single entries: on a GPU each would be a host sync)
        parent_rows = torch.where(draft.parents < 0, 0, draft.parents + 1)
        node_probs = probs[parent_rows.to(probs.device), draft.tokens.to(probs.device)].cpu()  # [num_nodes]
        threshold, entropy = threshold.cpu(), entropy.cpu()
        root, kids = children_lists(draft.parents.tolist())
        scores = torch.zeros(draft.num_nodes)
        path: list[int] = []
        row, options = 0, root
        while options:
            best = None
            for c in options:
                scores[c] = node_probs[c]
                if scores[c] > threshold[row] and (best is None or scores[c] > scores[best]):
                    best = c
            if best is None:
                break
            path.append(best)
            row, options = best + 1, kids[best]
        leaf = bool(path) and not kids[path[-1]]
        return Decision(torch.tensor(path, dtype=torch.long), None, BONUS if leaf else RECOVERED,
                        gate_scores=scores, info={"threshold_root": float(threshold[0]), "epsilon": self.epsilon,
                                                  "lossy": True, "entropy_root": float(entropy[0]) if math.isfinite(float(entropy[0])) else 0.0})
