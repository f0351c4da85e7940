"""Jacobi decoding: weight-free parallel guesses for the next K positions, refined by each verify pass.

After a step, the target's predictions at the rejected positions (made from a partly wrong prefix) become
the next step's guesses, shifted past what was committed; a fixed point of this iteration is exactly the
greedy continuation, so guesses converge on repetitive or formulaic text.
"""
from __future__ import annotations

import torch

from mtpflow.plugins import hookimpl
from mtpflow.strategies.pld import find_ngram_continuation
from mtpflow.types import DecodeState, Draft, StepRecord


class JacobiProposer:
    def __init__(self, seed_from_context: bool = True):
        # Guesses with no refinement yet are seeded from an n-gram lookup when one matches, else by
        # repeating the root token (the classic Jacobi initialisation pads with any token).
        self.seed_from_context = seed_from_context
        self.guesses: list[int] = []

    @hookimpl
    def propose(self, state: DecodeState, k: int) -> Draft:
        guesses = self.guesses[:k]
        if len(guesses) < k:
            seed = []
            if self.seed_from_context:
                seed = find_ngram_continuation(state.proposer_context(), 1, 3, k - len(guesses)).tolist()
            guesses = guesses + seed
            guesses = guesses + [guesses[-1] if guesses else state.root_token] * (k - len(guesses))
        return Draft.chain(guesses, source="jacobi")

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        n = record.draft.num_nodes
        accepted = record.decision.num_accepted
        if n == 0 or not record.draft.is_chain:
            self.guesses = []
            return
        # The next token sits where node `accepted` was; row accepted + 1 (that node) predicted the position
        # after it, from a wrong token there: that prediction and the ones after it are the new guesses.
        self.guesses = record.node_target_argmax[accepted + 1 :].tolist()
