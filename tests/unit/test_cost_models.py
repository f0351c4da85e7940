"""Cost models: the verify-cost curve, the cost-aware prompt lookup and the cost-aware draft model."""
from __future__ import annotations

import pytest

from helpers import hf_greedy, make_pipeline
from mtpflow.errors import ConfigError
from mtpflow.cost_model import CostCurve, expected_tokens
from mtpflow.strategies.pld import PromptLookupProposer

FLAT = {0: 1.0, 1: 1.0, 4: 1.0, 8: 1.0}  # a GPU-like curve: extra draft tokens are free
STEEP = {0: 1.0, 1: 3.0, 4: 6.0, 8: 9.0}  # every draft token costs far more than it can bring


def test_cost_curve_is_monotone_interpolated_and_extrapolated():
    curve = CostCurve({0: 0.1, 1: 0.2, 2: 0.15, 4: 0.3})  # K=2 faster than K=1: timing noise
    assert curve(0) == 1.0 and curve(1) == pytest.approx(2.0)
    assert curve(2) == pytest.approx(2.0)  # running maximum
    assert curve(3) == pytest.approx(2.5)  # halfway between 2.0 and 3.0
    assert curve(6) == pytest.approx(4.0)  # slope of the last segment continues
    with pytest.raises(ConfigError):
        CostCurve({1: 0.2})


def test_best_length_follows_cost_and_acceptance():
    assert CostCurve(FLAT).best_length(0.5, 10) == 10
    assert CostCurve(STEEP).best_length(0.9, 10) == 0
    mid = CostCurve({0: 1.0, 1: 1.1, 2: 1.2, 4: 1.4, 8: 1.8, 16: 2.6})
    low, high = mid.best_length(0.3, 16), mid.best_length(0.95, 16)
    assert 0 < low < high
    # the chosen length really is the best expected tokens per cost
    best = max(range(17), key=lambda n: expected_tokens(0.95, n) / mid(n))
    assert high == best


def test_pld_costs_validation():
    with pytest.raises(ConfigError, match="costs"):
        PromptLookupProposer(costs={1: 0.5})
    with pytest.raises(ConfigError, match="costs"):
        PromptLookupProposer(costs="fast")
    assert PromptLookupProposer(costs="auto").cost_mode == "auto"


def repetitive(vocab):
    return [int(x) % (vocab - 1) + 1 for x in range(7, 19)] * 4


def costs_override(table):
    return "strategy.propose.costs={" + ",".join(f"{k}:{v}" for k, v in table.items()) + "}"


def test_cost_aware_pld_drafts_only_when_it_pays(tiny):
    ids = repetitive(len(tiny.tokenizer))
    ref = hf_greedy(tiny.model, ids, 48)
    flat = make_pipeline(tiny, "pld", "max_new_tokens=48", "strategy.propose.min_ngram=1", costs_override(FLAT))
    steep = make_pipeline(tiny, "pld", "max_new_tokens=48", "strategy.propose.min_ngram=1", costs_override(STEEP))
    r_flat, r_steep = flat(prompt_ids=ids), steep(prompt_ids=ids)
    assert r_flat.token_ids == ref and r_steep.token_ids == ref
    assert r_steep.stats["mal"] == 1.0 and r_steep.stats["pld_skipped"] > 0  # never worth it: decodes plainly
    assert r_flat.stats["verify_forwards"] <= r_steep.stats["verify_forwards"]


def test_pld_auto_costs_measures_once_and_reports(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MTPFLOW_PROFILE", str(tmp_path / "profile.json"))  # no entry yet: the first run tunes it
    ids = repetitive(len(tiny.tokenizer))
    pipe = make_pipeline(tiny, "pld", "max_new_tokens=16")
    first = pipe(prompt_ids=ids)
    second = pipe(prompt_ids=ids)
    assert first.stats["pld_costs"] == "measured" and second.stats["pld_costs"] == "cached"
    assert first.token_ids == second.token_ids == hf_greedy(tiny.model, ids, 16)


def test_cost_aware_draft_model_skips_a_costly_drafter_and_probes(tiny):
    ids = repetitive(len(tiny.tokenizer))
    ref = hf_greedy(tiny.model, ids, 40)
    steep = "+strategy.propose.costs={0:1.0,1:30.0,8:60.0}"
    pipe = make_pipeline(tiny, "draft_model", "max_new_tokens=40", "strategy.propose.layers=1",
                         "strategy.propose.probe_every=4", steep)
    result = pipe(prompt_ids=ids)
    assert result.token_ids == ref
    stats = result.stats
    assert stats["draft_skipped_steps"] > 20  # mostly plain steps
    drafted = stats["verify_forwards"] - stats["draft_skipped_steps"]
    assert 1 <= drafted <= stats["verify_forwards"] // 4 + 1  # one probe every 4 idle steps at most
    free = make_pipeline(tiny, "draft_model", "max_new_tokens=40", "strategy.propose.layers=1",
                         "strategy.propose.cost_aware=false")
    assert free(prompt_ids=ids).token_ids == ref



def test_probe_schedule_backs_off_while_probes_are_rejected():
    """A rejected probe doubles the idle gap before the next one (up to 8x every); an accepted draft resets
    it, so a useless drafter costs almost nothing and a useful one is found again."""
    from mtpflow.cost_model import ProbeSchedule

    probes = ProbeSchedule(every=2)
    gaps, idle = [], 0
    for _ in range(60):  # the cost model never wants to draft; every probe is rejected
        if probes.should_probe():
            probes.observe(drafted=1, accepted=0)
            gaps.append(idle)
            idle = 0
        else:
            probes.observe(drafted=0, accepted=0)
            idle += 1
    assert gaps[:5] == [2, 4, 8, 16, 16]
    while not probes.should_probe():
        probes.observe(0, 0)
    probes.observe(drafted=1, accepted=1)  # this probe is accepted
    assert probes.gap == 2
    probes.observe(drafted=3, accepted=0)  # a chosen (not probing) draft rejected: no back-off
    assert probes.gap == 2
    never = ProbeSchedule(every=0)
    for _ in range(20):
        never.observe(0, 0)
    assert not never.should_probe()


def test_draft_model_and_auto_k_share_the_probe_back_off():
    from types import SimpleNamespace

    from mtpflow.strategies.draft_model import DraftModelProposer
    from mtpflow.strategies.hardware import CostCurve, HardwareAwareK
    from mtpflow.types import Draft

    def record(n, accepted):  # a chain of n drafted nodes
        draft = Draft.chain(list(range(n)))
        return SimpleNamespace(draft=draft, decision=SimpleNamespace(num_accepted=accepted))

    prop = DraftModelProposer(layers=1, probe_every=2, acceptance_prior=0.01)
    prop.curve, prop.base_seconds, prop.draft_seconds = CostCurve({0: 1.0, 1: 3.0, 8: 6.0}), 0.05, 0.01
    sel = HardwareAwareK(k="auto", costs={0: 1.0, 1: 3.0, 8: 6.0}, acceptance_prior=0.01, probe_every=2)
    sel.on_run_start(SimpleNamespace(device="cpu", model=None))
    for pick, end in ((lambda: prop.draft_length(4), prop.on_step_end), (lambda: sel.select_k(None), sel.on_step_end)):
        drafted_at = []
        for step in range(12):
            n = pick()
            end(record(n, 0))
            if n:
                drafted_at.append(step)
        assert drafted_at == [2, 7]  # probe after 2 idle steps; rejected, so the next after 4

def tree_draft():
    import torch

    from mtpflow.types import Draft

    # root children 0 (p .9) and 1 (p .05); 2 under 0 (p .8); 3 under 2 (p .5)
    parents = torch.tensor([-1, -1, 0, 2])
    probs = torch.tensor([0.9, 0.05, 0.8, 0.5])
    return Draft(tokens=torch.tensor([3, 4, 5, 6]), parents=parents, probs=probs)


def test_pfs_cost_budget_keeps_what_pays():
    import torch

    from mtpflow.strategies.pfs import PFSPruner

    draft = tree_draft()  # PFS: .9, .05, .72, .36
    flat = PFSPruner(threshold=0.0, costs=FLAT).prune(None, draft)
    assert flat.tolist() == [True, True, True, True]
    steep = PFSPruner(threshold=0.0, costs=STEEP).prune(None, draft)
    assert steep.tolist() == [False, False, False, False]
    mid = PFSPruner(threshold=0.0, costs={0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.9})
    keep = mid.prune(None, draft)
    # (1 + .9) / 1.1 < (1 + 1.62) / 1.2 < (1 + 1.98) / 1.3 > (1 + 2.03) / 1.9: the three best paths
    assert keep.tolist() == [True, False, True, True]
    assert mid._last_predicted == pytest.approx(1.98, abs=1e-5)
    assert torch.equal(PFSPruner(threshold=0.0).prune(None, draft), torch.tensor([True] * 4))  # costs off


def test_pfs_calibration_follows_acceptance():
    from types import SimpleNamespace

    from mtpflow.strategies.pfs import PFSPruner

    import torch

    pruner = PFSPruner(threshold=0.0, costs=FLAT)
    draft = tree_draft()
    none = SimpleNamespace(accepted=torch.zeros(0, dtype=torch.long))
    for _ in range(30):  # the drafter promises ~2 tokens a step and delivers none
        pruner.prune(None, draft)
        pruner.on_step_end(SimpleNamespace(draft=draft, decision=none))
    assert pruner.calibration < 0.1
    with pytest.raises(ConfigError):
        PFSPruner(costs={2: 1.0})


def test_pfs_calibrated_nodes_skip_threshold_and_scaling():
    """Nodes marked calibrated (a learned acceptance, like mtp's grafted lookup chain) pass the entropy
    threshold, are valued at their own PFS rather than c * PFS, and do not move c."""
    from types import SimpleNamespace

    import torch

    from mtpflow.strategies.pfs import PFSPruner
    from mtpflow.types import Draft

    # heads node 0 (pfs .9, uncalibrated), lookup chain 1 -> 2 (pfs .3, .27, calibrated)
    draft = Draft(torch.tensor([3, 4, 5]), torch.tensor([-1, -1, 1]), probs=torch.tensor([0.9, 0.3, 0.9]),
                  scores={"pfs": torch.tensor([0.9, 0.3, 0.27]), "calibrated": torch.tensor([0.0, 1.0, 1.0])})
    assert PFSPruner(threshold=0.5, adapt=0.0).prune(None, draft).tolist() == [True, True, True]
    assert PFSPruner(threshold=0.5, adapt=0.0, max_nodes=2).prune(None, draft).tolist() == [True, True, False]
    pruner = PFSPruner(threshold=0.0, adapt=0.0, costs={0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6})
    pruner._accepted, pruner._predicted = 0.1, 1.0  # heads promise 10x what they deliver: c = 0.1
    # values: .09 for the heads node, .3 and .27 for the chain: keep the chain, drop the heads node
    assert pruner.prune(None, draft).tolist() == [False, True, True]
    assert pruner._last_predicted == 0.0  # nothing uncalibrated kept: c is not updated
    kept = draft.subset(torch.tensor([False, True, True]))
    pruner.on_step_end(SimpleNamespace(draft=kept, decision=SimpleNamespace(accepted=torch.tensor([0, 1]))))
    assert pruner.calibration == pytest.approx(0.1)


def test_decayed_acceptance_learns_and_forgets_rejections():
    from mtpflow.cost_model import DecayedAcceptance

    est = DecayedAcceptance(prior=0.5, memory=0.9, prior_weight=2.0)
    assert est.value == pytest.approx(0.5)
    for _ in range(20):  # every draft of 4 rejected at its first token
        est.update(0, 4)
    low = est.value
    assert low < 0.15
    for _ in range(20):  # drafts not tried: rejections fade, so the drafter is tried again
        est.forget_rejections()
    assert est.value > 3 * low
    for _ in range(20):  # fully accepted 4-token drafts
        est.update(4, 4)
    assert est.value > 0.9



def test_batch_costs_are_measured_once_then_read_from_the_cache(tiny, tmp_path, monkeypatch):
    from mtpflow import cost_model
    from mtpflow.backends.hf import HFBackend

    monkeypatch.setenv("MTPFLOW_PROFILE", str(tmp_path / "profile.json"))
    calls = []
    grid = {(b, q): [0.01 * b * q, 0.011 * b * q] for b in (1, 4) for q in (1, 3)}
    monkeypatch.setattr(cost_model, "measure_batch_costs", lambda *a, **k: calls.append(1) or grid)
    backend = HFBackend(tiny.model)
    model, source = cost_model.load_batch_costs(tiny, backend)
    assert source == "measured" and model.table[(4, 3)] == pytest.approx(0.12)  # the fastest repeat
    again, source = cost_model.load_batch_costs(tiny, backend)
    assert source == "cached" and again.table == model.table and len(calls) == 1
