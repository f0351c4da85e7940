"""The re-scorer (stage ``rescore``): at the first position that failed the gate (or that dedup cut), put the
target's own token from the verify pass (argmax, or a sample when sampling), with no extra forward, and
count how often it did. An optional mode also cuts a lossy accept at its first low-confidence token."""
from __future__ import annotations

from dataclasses import replace

from mtpflow.errors import ConfigError, check_range
from mtpflow.plugins import hookimpl
from mtpflow.sampling import sample, target_probs
from mtpflow.types import RECOVERED, Decision, DecodeState, Draft, StepRecord, Verification

MODES = ("first_rejection", "low_confidence")


def rejected_children(draft: Draft, decision: Decision) -> list[int]:
    """Draft nodes that hang off the end of the accepted path (the candidates the gate refused there)."""
    last = -1 if decision.num_accepted == 0 else int(decision.accepted[-1])
    return [i for i, p in enumerate(draft.parents.tolist()) if p == last]


class TargetRescorer:
    """Fill the token at the cut with the target's own choice from the verify logits.

    Greedy: the argmax of the row after the accepted path, so with a verifying gate the output stays
    lossless. Sampling: a sample from the target distribution; after a gate rejection the refused draft
    tokens are removed first (the residual of a deterministic draft), after a dedup cut nothing is removed
    (the cut did not depend on the target's probabilities, so a plain sample keeps the target distribution).

    ``mode=low_confidence`` also re-scores a lossy accept: the accepted path is cut at its first token whose
    target probability is below ``min_prob`` and the target's token goes there.
    """

    def __init__(self, mode: str = "first_rejection", min_prob: float = 0.5):
        if mode not in MODES:
            raise ConfigError(f"strategy.rescore.mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.min_prob = float(check_range("strategy.rescore.min_prob", min_prob, 0, 1))
        self.recovered = 0  # tokens this re-scorer put at a failed draft position
        self.corrections = 0  # ... of which differ from the draft token they displaced
        self.low_confidence_cuts = 0  # accepted paths cut by mode=low_confidence
        self.new_tokens = 0

    def _low_confidence_cut(self, state: DecodeState, draft: Draft, verification: Verification,
                            decision: Decision) -> Decision:
        if decision.num_accepted == 0:
            return decision
        temperature = state.sampling.temperature or 1.0
        probs = (verification.logits.float() / temperature).softmax(-1)
        path = decision.accepted.tolist()
        rows = [0] + [i + 1 for i in path[:-1]]  # the row that scored each accepted node
        for depth, (node, row) in enumerate(zip(path, rows)):
            if float(probs[row, int(draft.tokens[node])]) < self.min_prob:
                info = {**decision.info, "low_confidence_nodes": path[depth:]}
                return replace(decision, accepted=decision.accepted[:depth], next_token=None,
                               next_kind=RECOVERED, info=info)
        return decision

    @hookimpl
    def rescore(self, state: DecodeState, draft: Draft, verification: Verification, decision: Decision) -> Decision:
        if self.mode == "low_confidence":
            decision = self._low_confidence_cut(state, draft, verification, decision)
        if decision.next_token is not None:
            return decision
        row = 0 if decision.num_accepted == 0 else int(decision.accepted[-1]) + 1
        logits = verification.logits[row]
        cut = decision.info.get("deduped_nodes") or decision.info.get("low_confidence_nodes")
        refused = [] if cut else rejected_children(draft, decision)
        displaced = int(draft.tokens[cut[0]]) if cut else (int(draft.tokens[refused[0]]) if refused else None)
        rng = state.extras.get("rng")
        if state.sampling.greedy:
            token = int(logits.argmax())
        else:
            p = target_probs(logits, state.sampling)
            residual = p.clone()
            if refused:
                residual[draft.tokens[refused].to(residual.device)] = 0.0
            token = sample(residual / residual.sum() if float(residual.sum()) > 0 else p, rng)
        info = {**decision.info, "rescored_from": displaced}
        return replace(decision, next_token=token, decided_by="rescore", info=info)

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        self.new_tokens += len(record.emitted)
        decision = record.decision
        if "low_confidence_nodes" in decision.info:
            self.low_confidence_cuts += 1
        recovered_here = (record.draft.num_nodes > 0 and decision.decided_by == "rescore"
                          and decision.next_kind == RECOVERED
                          and len(record.emitted) == decision.num_accepted + 1)  # not cut by a stop
        if not recovered_here:
            return
        self.recovered += 1
        displaced = decision.info.get("rescored_from")
        self.corrections += int(displaced is not None and displaced != record.emitted[-1])

    @hookimpl
    def run_stats(self) -> dict:
        return {
            "rescore_recovered_tokens": self.recovered,
            # share of all emitted tokens (prefill token excluded) that the re-scorer recovered
            "rescore_recovery_rate": round(self.recovered / self.new_tokens, 4) if self.new_tokens else 0.0,
            # share of recovered tokens that differ from the draft token they replaced
            "rescore_correction_rate": round(self.corrections / self.recovered, 4) if self.recovered else 0.0,
            "rescore_low_confidence_cuts": self.low_confidence_cuts,
        }

