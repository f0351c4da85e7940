"""Prompt lookup decoding (PLD): draft the continuation of the most recent earlier occurrence of the last
n tokens, searched over the prompt and the output so far. No weights, no extra forward."""
from __future__ import annotations

import torch

from mtpflow.errors import ConfigError, check_range
from mtpflow.hookspecs import hookimpl
from mtpflow.kernels import ngram_continuation
from mtpflow.strategies.k_selectors import check_k
from mtpflow.types import DecodeState, Draft, StepRecord


def find_ngram_continuation(context: torch.Tensor, min_ngram: int, max_ngram: int, k: int) -> torch.Tensor:
    """[<= k] tokens that followed the latest earlier match of the longest matching suffix n-gram
    (n from max_ngram down to min_ngram); empty when nothing matches. Runs the ``mtpflow.kernels`` n-gram
    match (Triton kernel or torch reference, per the ``kernels`` setting)."""
    return ngram_continuation(context, min_ngram, max_ngram, k)


class PromptLookupProposer:
    """n-gram lookup over prompt + output; a chain of up to K tokens, or nothing when no n-gram matches.

    Cost-aware when ``min_expected_accept`` > 0: a verify forward over several tokens costs more than a
    one-token forward (about 1.9x on a 2-core CPU, about 1.0x on a GPU; ``python -m mtpflow.bench mode=cost``
    measures it), so a draft only pays when it is expected to gain more than that extra cost. The proposer
    keeps, per matched n-gram length, a decayed count of accepted tokens and rejections, estimates the
    per-token acceptance a, and drafts only when a (1 - a^L) / (1 - a) >= min_expected_accept. Skipped
    matches slowly forget rejections, so it tries again later. The output is unchanged either way.
    """

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, max_draft: int | None = None,
                 min_expected_accept: float = 0.0, decay: float = 0.9):
        self.min_ngram = check_k("strategy.propose.min_ngram", min_ngram)
        self.max_ngram = check_k("strategy.propose.max_ngram", max_ngram)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"strategy.propose: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_draft = None if max_draft is None else check_k("strategy.propose.max_draft", max_draft)
        self.min_expected_accept = float(check_range("strategy.propose.min_expected_accept", min_expected_accept, 0))
        self.decay = float(check_range("strategy.propose.decay", decay, 0, 1))
        # per matched n: [accepted tokens, rejection events], decayed; optimistic prior so drafting starts
        self.evidence = {n: [2.0, 1.0] for n in range(self.min_ngram, self.max_ngram + 1)}
        self.last_match: int | None = None
        self.skipped = 0

    def expected_accept(self, n: int, length: int) -> float:
        accepted, rejected = self.evidence[n]
        a = accepted / (accepted + rejected)
        return length if a >= 1.0 else a * (1 - a**length) / (1 - a)

    @hookimpl
    def propose(self, state: DecodeState, k: int) -> Draft:
        k = min(k, self.max_draft) if self.max_draft else k
        context = state.proposer_context()
        self.last_match = None
        if not self.min_expected_accept:
            return Draft.chain(find_ngram_continuation(context, self.min_ngram, self.max_ngram, k), "prompt_lookup")
        for n in range(self.max_ngram, self.min_ngram - 1, -1):  # longest match first
            follow = find_ngram_continuation(context, n, n, k)
            if follow.numel():
                if self.expected_accept(n, int(follow.numel())) < self.min_expected_accept:
                    self.evidence[n][1] *= self.decay  # forget rejections slowly, to try again later
                    self.skipped += 1
                    return Draft.empty("prompt_lookup")
                self.last_match = n
                return Draft.chain(follow, source="prompt_lookup")
        return Draft.empty("prompt_lookup")

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        if self.last_match is None or record.draft.num_nodes == 0:
            return
        evidence = self.evidence[self.last_match]
        accepted = record.decision.num_accepted
        evidence[0] = self.decay * evidence[0] + accepted
        evidence[1] = self.decay * evidence[1] + (accepted < record.draft.num_nodes)
