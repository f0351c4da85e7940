"""The core's default stage implementations, registered ``trylast`` in every run so a strategy or a
third-party plugin can take any stage over: no drafting (K = 0), the shared-KV verify forward, the greedy
gate, and the re-scorer that puts the target's own token at the first rejected position."""
from __future__ import annotations

from mtpflow.plugins.hookspecs import hookimpl
from mtpflow.sampling import choose
from mtpflow.types import Decision, DecodeState, Draft, Verification


class CoreDefaults:
    reads_only_target_argmax = True  # the greedy gate, and the re-scorer's choose() is an argmax when greedy

    @hookimpl(trylast=True)
    def select_k(self, state: DecodeState) -> int:
        return 0

    @hookimpl(trylast=True)
    def propose(self, state: DecodeState, k: int) -> Draft:
        return Draft.empty()

    @hookimpl(trylast=True)
    def verify(self, state: DecodeState, draft: Draft, target) -> Verification:
        return target.verify(state.root_token, draft, state.next_position)

    @hookimpl(trylast=True)
    def gate(self, state: DecodeState, draft: Draft, verification: Verification) -> Decision:
        from mtpflow.strategies.gates import GreedyGate

        return GreedyGate().gate(state, draft, verification)

    @hookimpl(trylast=True)
    def rescore(self, state: DecodeState, draft: Draft, verification: Verification, decision: Decision) -> Decision:
        """Fill a missing next token with the target's own choice after the accepted path (no extra forward)."""
        if decision.next_token is not None:
            return decision
        row = 0 if decision.num_accepted == 0 else int(decision.accepted[-1]) + 1
        token = choose(verification.logits[row], state.sampling, state.extras.get("rng"))
        from dataclasses import replace

        return replace(decision, next_token=token, decided_by="rescore")
