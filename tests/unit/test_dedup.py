"""n-gram dedup: which tokens complete a repeated run, the keep-mask, lossless output behind a greedy gate,
and the effect behind a lossy gate (no accepted token completes a run)."""
from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, make_pipeline
from mtpflow.errors import ConfigError
from mtpflow.plugins import hookimpl
from mtpflow.strategies.dedup import NgramDedup, repeated_run_end
from mtpflow.types import ACCEPTED, DEDUPED, Decision, DecodeState, Draft, SamplingParams

DEDUP = "strategy.dedup=[{_target_: mtpflow.strategies.dedup.NgramDedup, min_repeats: [4, 3]}]"
RESCORE = "strategy.rescore={_target_: mtpflow.strategies.rescore.TargetRescorer}"
ACCEPT_ALL = ("strategy.gate.epsilon=0.0", "strategy.gate.delta=0.0")  # typical gate accepting every draft


def test_repeated_run_end():
    runs = {1: 4, 2: 3}
    assert repeated_run_end([9, 5, 5, 5, 5], runs)
    assert not repeated_run_end([9, 5, 5, 5], runs)
    assert repeated_run_end([1, 2, 1, 2, 1, 2], runs)
    assert not repeated_run_end([1, 2, 1, 2, 1], runs)
    assert not repeated_run_end([1, 2, 1, 2, 1, 3], runs)
    assert repeated_run_end([7, 7], {1: 2})


def state_of(tokens):
    t = torch.tensor(tokens)
    return DecodeState(tokens=t, prompt_len=1, step=0, next_position=len(tokens), sampling=SamplingParams(),
                       max_new_tokens=64)


def test_mask_cuts_at_the_completing_token():
    dedup = NgramDedup(min_repeats=[4])
    draft = Draft.chain([5, 5, 6, 5])
    decision = Decision(accepted=torch.arange(4), next_token=1)
    # committed ...5 5 then draft 5 5: the second draft token is the fourth 5 in a row
    keep = dedup.dedup(state_of([3, 5, 5]), draft, decision)
    assert keep.tolist() == [True, False, False, False]
    assert dedup.dedup(state_of([3, 4, 5]), draft, decision).tolist() == [True] * 4


def test_validation():
    with pytest.raises(ConfigError, match="min_repeats must be a whole number >= 2, got 1"):
        NgramDedup(min_repeats=[1])
    with pytest.raises(ConfigError, match="min_repeats needs one count"):
        NgramDedup(min_repeats=[])
    with pytest.raises(ConfigError, match="lookback must be a whole number >= 6, got 4"):  # a bigram 3 times
        NgramDedup(min_repeats=[4, 3], lookback=4)
    assert NgramDedup(min_repeats=4).min_repeats == {1: 4} and NgramDedup(lookback=8.0).lookback == 8


def repetitive_prompt(vocab):
    g = torch.Generator().manual_seed(7)
    unit = torch.randint(1, vocab, (3,), generator=g).tolist()
    return [5] + unit * 8 + [6, 6, 6, 6, 6, 6]


def test_lossless_with_greedy_gate(tiny):
    ids = repetitive_prompt(len(tiny.tokenizer))
    want = hf_greedy(tiny.model, ids, 48)
    pipe = make_pipeline(tiny, "pld", "max_new_tokens=48", "strategy.propose.min_ngram=1", DEDUP, RESCORE,
                         "trace=off")
    got = pipe(prompt_ids=ids)
    assert got.token_ids == want


class RepeatRootProposer:
    """Drafts the root token K times: the degenerate loop a lossy gate would happily accept."""

    @hookimpl
    def propose(self, state, k):
        return Draft.chain([state.root_token] * k, source="repeat")


def test_effect_with_lossy_gate(tiny):
    """Behind an accept-everything gate a repeating draft is taken wholesale; dedup refuses every accepted
    token that would complete a run, marks it DEDUPED in the step records, and the re-scorer fills the cut."""
    ids = repetitive_prompt(len(tiny.tokenizer))
    common = ("max_new_tokens=48", *ACCEPT_ALL, RESCORE, "trace=off")
    plain = make_pipeline(tiny, "typical", *common)(prompt_ids=ids, extra_plugins=(RepeatRootProposer(),))
    deduped = make_pipeline(tiny, "typical", *common, DEDUP)(prompt_ids=ids, extra_plugins=(RepeatRootProposer(),))
    assert repeated_run_end(plain.token_ids[:8], {1: 4})  # without dedup: one token over and over
    assert plain.token_ids != deduped.token_ids
    marks = [s for r in deduped.steps for s in r.decision.node_status if s == DEDUPED]
    assert marks
    runs = {1: 4, 2: 3}
    for record in deduped.steps:
        before = record.state.tokens.tolist()
        for tok, kind in zip(record.emitted, record.emitted_kinds):
            before.append(tok)
            assert not (kind == ACCEPTED and repeated_run_end(before, runs))
    assert deduped.stats["rescore_recovered_tokens"] >= len([r for r in deduped.steps
                                                              if "deduped_nodes" in r.decision.info])
