"""Prompt lookup decoding (PLD): draft the continuation of the most recent earlier occurrence of the last
n tokens, searched over the prompt and the output so far. No weights, no extra forward."""
from __future__ import annotations

from typing import Any

import torch

from mtpflow.errors import ConfigError, check_k, check_range
from mtpflow.plugins import hookimpl
from mtpflow.kernels import ngram_continuation, ngram_match
from mtpflow.cost_model import AUTO, CostCurve, DecayedAcceptance, check_costs, load_verify_costs
from mtpflow.types import DecodeState, Draft, StepRecord


def find_ngram_continuation(context: torch.Tensor, min_ngram: int, max_ngram: int, k: int) -> torch.Tensor:
    """[<= k] tokens that followed the latest earlier match of the longest matching suffix n-gram
    (n from max_ngram down to min_ngram); empty when nothing matches. Runs the ``mtpflow.kernels`` n-gram
    match (Triton kernel or torch reference, per the ``kernels`` setting)."""
    return ngram_continuation(context, min_ngram, max_ngram, k)


LOOKUP_PRIOR = 2 / 3  # prior per-token acceptance of a lookup draft: optimistic, so drafting starts


def lookup_acceptance(min_ngram: int, max_ngram: int, memory: float) -> dict[int, DecayedAcceptance]:
    """One acceptance estimate per matched n-gram length (longer matches are accepted more often)."""
    return {n: DecayedAcceptance(LOOKUP_PRIOR, memory) for n in range(min_ngram, max_ngram + 1)}


class PromptLookupProposer:
    """n-gram lookup over prompt + output; a chain of up to K tokens, or nothing when no n-gram matches.

    Cost-aware when ``costs`` is set (``auto``: the verify-forward cost per K measured once on this device and
    model and cached, as ``python -m mtpflow.bench mode=cost`` shows; or a {K: seconds} mapping). A verify
    forward over several tokens can cost more than a one-token forward (markedly on a CPU, barely on a GPU;
    measured: docs/bench/code-figures.md#pld-promptlookupproposer), so a draft only pays when the tokens it is
    expected to add beat its extra cost. The proposer keeps, per matched n-gram length, decayed counts of
    accepted draft tokens and of rejections, estimates the per-token acceptance a, and drafts the length L
    (0 = no draft) with the most expected tokens, 1 + a + ... + a^L, per unit of cost. Skipped matches slowly
    forget rejections, so it tries again later. The output is the same either way; only the speed changes.
    """

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, max_draft: int | None = None,
                 decay: float = 0.9, costs=None):
        self.min_ngram = check_k("strategy.propose.min_ngram", min_ngram)
        self.max_ngram = check_k("strategy.propose.max_ngram", max_ngram)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"strategy.propose: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_draft = None if max_draft is None else check_k("strategy.propose.max_draft", max_draft)
        self.decay = float(check_range("strategy.propose.decay", decay, 0, 1))
        self.cost_mode = check_costs(costs)
        self.curve: CostCurve | None = None if self.cost_mode in (None, AUTO) else CostCurve(self.cost_mode)
        self.estimates = lookup_acceptance(self.min_ngram, self.max_ngram, self.decay)
        self.last_match: int | None = None
        self.skipped = 0
        self.trimmed = 0  # drafts cut shorter than the match by the cost model

    def acceptance(self, n: int) -> float:
        return self.estimates[n].value

    @hookimpl
    def on_run_start(self, context) -> dict[str, Any] | None:
        if self.cost_mode != AUTO or context.model is None:
            return None
        costs, source = load_verify_costs(context)
        self.curve = CostCurve(costs)
        return {"pld_costs": source, **{f"pld_cost_k{k}": round(self.curve(k), 3) for k in (1, 2, 4, 8)}}

    @hookimpl
    def run_stats(self) -> dict[str, Any]:
        return {"pld_skipped": self.skipped, "pld_trimmed": self.trimmed}

    @hookimpl
    def propose(self, state: DecodeState, k: int) -> Draft:
        k = min(k, self.max_draft) if self.max_draft else k
        context = state.proposer_context()
        self.last_match = None
        if self.curve is None:
            return Draft.chain(find_ngram_continuation(context, self.min_ngram, self.max_ngram, k), "prompt_lookup")
        n, follow = ngram_match(context, self.min_ngram, self.max_ngram, k)
        if n is None:
            return Draft.empty("prompt_lookup")
        # how many of the matched tokens pay for their verify cost (0: skip this match)
        length = self.curve.best_length(min(self.acceptance(n), 0.999), int(follow.numel()))
        if length == 0:
            self.estimates[n].forget_rejections()  # so it tries again later
            self.skipped += 1
            return Draft.empty("prompt_lookup")
        self.trimmed += length < follow.numel()
        self.last_match = n
        return Draft.chain(follow[:length], source="prompt_lookup")

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        if self.last_match is None or record.draft.num_nodes == 0:
            return
        self.estimates[self.last_match].update(record.decision.num_accepted, record.draft.num_nodes)
