"""The target re-scorer: the target's token at the cut (argmax, a residual sample when sampling), the
low-confidence mode, and the recovered-token counts it adds to the run's stats."""
from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, make_pipeline
from mtpflow.errors import ConfigError
from mtpflow.plugins import hookimpl
from mtpflow.strategies.rescore import TargetRescorer
from mtpflow.types import RECOVERED, Decision, DecodeState, Draft, SamplingParams, Verification

RESCORE = "strategy.rescore={_target_: mtpflow.strategies.rescore.TargetRescorer}"


def state_of(temperature=0.0, seed=0):
    return DecodeState(tokens=torch.tensor([1, 2, 3]), prompt_len=2, step=0, next_position=3,
                       sampling=SamplingParams(temperature=temperature), max_new_tokens=16,
                       extras={"rng": torch.Generator().manual_seed(seed)})


def logits_rows(*rows):
    """Logits whose softmax is (close to) the given probability rows over a 4-token vocabulary."""
    return torch.tensor(rows, dtype=torch.float32).clamp(min=1e-9).log()


def test_fills_argmax_after_the_accepted_path():
    draft = Draft.chain([2, 3])
    ver = Verification(logits_rows([0.1, 0.1, 0.7, 0.1], [0.1, 0.2, 0.1, 0.6], [0.5, 0.2, 0.2, 0.1]), None, 0.0)
    decision = Decision(accepted=torch.tensor([0]), next_token=None)
    out = TargetRescorer().rescore(state_of(), draft, ver, decision)
    assert out.next_token == 3 and out.decided_by == "rescore" and out.info["rescored_from"] == 3
    assert decision.next_token is None  # the input is not mutated
    filled = Decision(accepted=torch.tensor([0]), next_token=1)
    assert TargetRescorer().rescore(state_of(), draft, ver, filled) is filled


def test_sampling_residual_never_repeats_the_refused_token():
    draft = Draft.chain([2])
    ver = Verification(logits_rows([0.05, 0.05, 0.85, 0.05], [0.25, 0.25, 0.25, 0.25]), None, 0.0)
    decision = Decision(accepted=torch.zeros(0, dtype=torch.long), next_token=None)
    got = [TargetRescorer().rescore(state_of(1.0, seed=s), draft, ver, decision).next_token for s in range(200)]
    assert 2 not in got and set(got) == {0, 1, 3}
    # a dedup cut does not depend on the target's probabilities: a plain sample (token 2 allowed)
    cut = Decision(accepted=torch.zeros(0, dtype=torch.long), next_token=None, info={"deduped_nodes": [0]})
    got = [TargetRescorer().rescore(state_of(1.0, seed=s), draft, ver, cut).next_token for s in range(200)]
    assert got.count(2) > 120


def test_low_confidence_mode_cuts_a_lossy_accept():
    draft = Draft.chain([2, 1, 3])
    ver = Verification(logits_rows([0.1, 0.1, 0.7, 0.1], [0.3, 0.3, 0.1, 0.3], [0.1, 0.1, 0.1, 0.7],
                                   [0.7, 0.1, 0.1, 0.1]), None, 0.0)
    decision = Decision(accepted=torch.arange(3), next_token=None, info={"lossy": True})
    out = TargetRescorer(mode="low_confidence", min_prob=0.5).rescore(state_of(), draft, ver, decision)
    # node 1 (token 1, target probability 0.3) is cut; the target's own token after node 0 goes there
    assert out.accepted.tolist() == [0] and out.next_token == 0 and out.next_kind == RECOVERED
    assert out.info["low_confidence_nodes"] == [1, 2]
    kept = TargetRescorer().rescore(state_of(), draft, ver, decision)
    assert kept.accepted.tolist() == [0, 1, 2] and kept.next_token == 0


def test_validation():
    with pytest.raises(ConfigError):
        TargetRescorer(mode="sometimes")
    with pytest.raises(ConfigError):
        TargetRescorer(min_prob=1.5)


class OracleProposer:
    """Drafts the reference greedy continuation, so the greedy gate accepts long paths."""

    def __init__(self, ref):
        self.ref = ref

    @hookimpl
    def propose(self, state, k):
        g = state.num_generated
        return Draft.chain(self.ref[g:g + k], source="oracle")


class CutAfterFirst:
    """A dedup filter that refuses everything after the first accepted token."""

    @hookimpl
    def dedup(self, state, draft, decision):
        keep = torch.zeros(decision.num_accepted, dtype=torch.bool)
        keep[0] = True
        return keep


def test_counts_in_stats_and_lossless_behind_greedy_cuts(tiny):
    """Dedup cuts leave next_token to the re-scorer; output stays HF greedy and the counts match the steps."""
    ids = [5] + [7, 8] * 10 + [9] * 8
    ref = hf_greedy(tiny.model, ids, 40)
    pipe = make_pipeline(tiny, "pld", "max_new_tokens=40", "k=4", RESCORE, "trace=off")
    result = pipe(prompt_ids=ids, extra_plugins=(OracleProposer(ref), CutAfterFirst()))
    assert result.token_ids == ref
    recovered = sum(1 for r in result.steps if r.decision.decided_by == "rescore" and r.draft.num_nodes
                    and r.decision.next_kind == RECOVERED and len(r.emitted) == r.decision.num_accepted + 1)
    assert recovered > 5 and result.stats["rescore_recovered_tokens"] == recovered
    assert result.stats["rescore_recovery_rate"] == pytest.approx(recovered / (result.stats["new_tokens"] - 1), abs=1e-4)
    assert result.stats["rescore_correction_rate"] == 0.0  # the cut tokens were the target's own


@pytest.mark.default_model
def test_domain_aware_is_lossless_on_the_default_model(default_loaded):
    """The headline strategy (classifier K, prompt lookup, dedup, re-scorer, KV window) emits HF greedy's tokens."""
    pipe = make_pipeline(default_loaded, "domain_aware", "max_new_tokens=40", "trace=off")
    prompt = "Continue this list exactly: data, data, data, data, data, data, data, data,"
    result = pipe(prompt)
    assert result.token_ids == hf_greedy(default_loaded.model, pipe.encode(prompt), 40)
    assert result.stats["domain"] and result.stats["domain_k"] >= 1
    assert "rescore_recovered_tokens" in result.stats
