"""The grafts' ledger in ``mtp_heads`` (mtpflow/strategies/mtp_heads.py ``GraftLedger``): a graft whose own work costs
more than its accepted tokens are worth sits out a pause and is tried again; one that pays stays on; resting or not,
the heads' tree stays lossless, and the run's stats say how many steps each graft sat out. A repeated request keeps
its suffix graft: test_training_free_drafters_default.py."""
from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, make_pipeline
from mtpflow.strategies.mtp_heads import GraftLedger
from test_training_free_drafters import prompts


def test_a_graft_that_costs_more_than_it_gains_rests_then_is_tried_again():
    ledger = GraftLedger(warmup=4, pause=3, memory=0.9)
    for _ in range(3):
        assert ledger.active()
        ledger.observe(seconds=1e-3, tokens=0, seconds_per_token=5e-3)
    assert ledger.resting == 0  # no verdict before the warm-up's evidence
    assert ledger.active()
    ledger.observe(seconds=1e-3, tokens=0, seconds_per_token=5e-3)
    assert ledger.rests == 1
    assert [ledger.active() for _ in range(4)] == [False, False, False, True]  # a pause, then on again
    assert ledger.rested_steps == 3
    assert ledger.evidence == 0  # a fresh warm-up before the next verdict
    for _ in range(3):
        ledger.observe(seconds=1e-3, tokens=1, seconds_per_token=5e-3)  # now its tokens pay: 5 ms against 1 ms
    ledger.observe(seconds=1e-3, tokens=1, seconds_per_token=5e-3)
    assert ledger.resting == 0 and ledger.rests == 1


def test_a_graft_that_pays_never_rests():
    ledger = GraftLedger(warmup=2, pause=8)
    for step in range(200):
        assert ledger.active()
        ledger.observe(seconds=2e-4, tokens=step % 3 == 0, seconds_per_token=4e-3)  # 1.3 ms a step against 0.2
    assert ledger.rests == 0


@pytest.mark.parametrize("rest", [False, True])
def test_mtp_heads_stays_lossless_with_its_grafts_resting(tiny, tmp_path, monkeypatch, rest):
    from test_heads_lossless import random_heads

    if rest:  # every step's work costs a second and gains nothing: after the warm-up the grafts sit out pauses
        real = GraftLedger.observe
        monkeypatch.setattr(GraftLedger, "observe", lambda self, s, t, p: real(self, s + 1.0, 0, p))
    folder = random_heads(tiny, "medusa", tmp_path / "medusa")
    pipe = make_pipeline(tiny, "mtp_heads", "max_new_tokens=32", "trace=off", f"strategy.propose.heads={folder}",
                         "strategy.prune.0.costs=null", "strategy.prune.0.max_nodes=16")
    rested = drafted = 0
    for i, ids in enumerate(prompts(len(tiny.tokenizer), 4, seed=5)):
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(tiny.model, ids, 32), f"prompt {i}"
        rested += result.stats["recycling_rested_steps"] + result.stats["suffix_rested_steps"]
        drafted += result.stats["recycling_drafts"]
    if rest:
        assert rested > 0
    else:  # the tiny model's steps are cheap, but resting needs 16 steps of evidence first: the grafts did draft
        assert drafted > 0


