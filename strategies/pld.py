"""Prompt lookup decoding (PLD): draft the continuation of the most recent earlier occurrence of the last
n tokens, searched over the prompt and the output so far. No weights, no extra forward."""
from __future__ import annotations

import torch

from mtpflow.errors import ConfigError
from mtpflow.hookspecs import hookimpl
from mtpflow.kernels import ngram_continuation
from mtpflow.strategies.k_selectors import check_k
from mtpflow.types import DecodeState, Draft


def find_ngram_continuation(context: torch.Tensor, min_ngram: int, max_ngram: int, k: int) -> torch.Tensor:
    """[<= k] tokens that followed the latest earlier match of the longest matching suffix n-gram
    (n from max_ngram down to min_ngram); empty when nothing matches. Runs the ``mtpflow.kernels`` n-gram
    match (Triton kernel or torch reference, per the ``kernels`` setting)."""
    return ngram_continuation(context, min_ngram, max_ngram, k)


class PromptLookupProposer:
    """n-gram lookup over prompt + output; a chain of up to K tokens, or nothing when no n-gram matches."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, max_draft: int | None = None):
        self.min_ngram = check_k("strategy.propose.min_ngram", min_ngram)
        self.max_ngram = check_k("strategy.propose.max_ngram", max_ngram)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"strategy.propose: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_draft = None if max_draft is None else check_k("strategy.propose.max_draft", max_draft)

    @hookimpl
    def propose(self, state: DecodeState, k: int) -> Draft:
        k = min(k, self.max_draft) if self.max_draft else k
        follow = find_ngram_continuation(state.proposer_context(), self.min_ngram, self.max_ngram, k)
        return Draft.chain(follow, source="prompt_lookup")
