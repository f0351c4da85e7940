"""The trace recorder through the real pipeline on the tiny model: every emitted token has an event in output
order, statuses follow the gate, pruned nodes are recorded, interrupted runs keep what was recorded, and a
failing database never breaks a decode."""
from __future__ import annotations

import pytest
import torch

from helpers import make_pipeline
from mtpflow.config import compose
from mtpflow.plugins import hookimpl
from mtpflow.plugins.manager import default_run_plugins
from mtpflow.traces import TraceStore
from mtpflow.types import RECOVERED, Decision

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]


def traced(tiny, db, strategy="draft_model", *overrides):
    # cost-aware drafting would skip a 1-layer drafter on a tiny model; these tests need its drafts
    extra = ["strategy.propose.layers=1", "strategy.propose.cost_aware=false"] if strategy == "draft_model" else []
    cfg = compose([f"strategy={strategy}", f"trace.db={db}"])
    return make_pipeline(tiny, strategy, f"trace.db={db}", "max_new_tokens=24", *extra, *overrides,
                         run_plugins=default_run_plugins(cfg))


def emitted_ids(store, run_id):
    return [e["token_id"] for e in sorted((e for e in store.token_events(run_id) if e["emitted"]),
                                            key=lambda e: e["position"])]


@pytest.mark.parametrize("strategy", ["draft_model", "jacobi", "pld", "typical"])
def test_every_emitted_token_recorded_in_order(tiny, tmp_path, strategy):
    db = tmp_path / "t.db"
    result = traced(tiny, db, strategy)(prompt_ids=PROMPT)
    store = TraceStore(db)
    assert result.run_id is not None and result.stats["trace_run_id"] == result.run_id
    run = store.get_run(result.run_id)
    assert run["status"] == "complete" and run["strategy"] == strategy and run["output_text"] == result.text
    assert run["stats"]["new_tokens"] == len(result.token_ids)
    assert run["config"]["strategy"]["name"] == strategy
    assert emitted_ids(store, result.run_id) == result.token_ids
    steps = store.steps(result.run_id)
    assert len(steps) == len(result.steps)
    for rec, row in zip(result.steps, steps):
        assert (row["k"], row["num_kept"], row["accepted_length"], row["num_emitted"]) == (
            rec.k, rec.draft.num_nodes, rec.decision.num_accepted, len(rec.emitted))
        assert "verify" in row["stage_seconds"]
    events = store.token_events(result.run_id)
    # one event per kept draft node plus the recovered/bonus/plain token of every step, plus the first token
    expected = 1 + sum(r.draft.num_nodes + (len(r.emitted) > r.decision.num_accepted) for r in result.steps)
    assert len(events) == expected
    for e in events:
        if e["status"] == "accepted":
            assert e["decided_by"] == "gate" and e["depth"] >= 1
        if e["status"] in ("recovered", "bonus"):
            assert e["emitted"] and e["depth"] is None


def test_draft_statuses_and_scores(tiny, tmp_path):
    db = tmp_path / "t.db"
    result = traced(tiny, db)(prompt_ids=PROMPT)
    events = TraceStore(db).token_events(result.run_id)
    statuses = {e["status"] for e in events}
    assert {"accepted", "rejected", "recovered"} <= statuses
    for e in events:
        if e["status"] == "accepted":  # a greedy gate accepts exactly the target's own choice
            assert e["matches_target"] is True and e["target_prob"] is not None
        if e["status"] == "rejected" and e["depth"] == 1:
            assert e["matches_target"] is False


class DropDeepest:
    """A test pruner: drops the deepest node of every draft of two or more nodes."""

    @hookimpl
    def prune(self, state, draft):
        if draft.num_nodes < 2:
            return None
        depth = draft.depths()
        return depth < depth.max()


class RefuseAll:
    """A test gate that accepts nothing (the re-scorer then fills in the target's token)."""

    @hookimpl
    def gate(self, state, draft, verification):
        return Decision(accepted=torch.zeros(0, dtype=torch.long), next_token=None, next_kind=RECOVERED)


def test_pruned_nodes_are_recorded(tiny, tmp_path):
    db = tmp_path / "t.db"
    result = traced(tiny, db, "draft_model", "k=3")(prompt_ids=PROMPT, extra_plugins=(DropDeepest(),))
    store = TraceStore(db)
    pruned = [e for e in store.token_events(result.run_id) if e["status"] == "pruned"]
    steps = store.steps(result.run_id)
    assert len(pruned) == sum(s["num_proposed"] - s["num_kept"] for s in steps) > 0
    assert all(e["decided_by"] == "prune" and not e["emitted"] for e in pruned)
    assert emitted_ids(store, result.run_id) == result.token_ids


def test_gate_refusing_the_targets_token_is_gated(tiny, tmp_path):
    db = tmp_path / "t.db"
    result = traced(tiny, db)(prompt_ids=PROMPT, extra_plugins=(RefuseAll(),))
    events = TraceStore(db).token_events(result.run_id)
    gated = [e for e in events if e["status"] == "gated"]
    assert gated and all(e["matches_target"] and e["depth"] == 1 for e in gated)
    assert not any(e["status"] == "accepted" for e in events)


def test_keyboard_interrupt_marks_run_interrupted(tiny, tmp_path):
    db = tmp_path / "t.db"
    seen = []

    def on_step(record, tokens):
        seen.extend(tokens)
        if len(seen) >= 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        traced(tiny, db)(prompt_ids=PROMPT, on_step=on_step)
    store = TraceStore(db)
    run = store.list_runs()[0]
    assert run["status"] == "interrupted"
    assert emitted_ids(store, run["id"]) == seen  # everything decoded before the interrupt was kept


def test_closing_a_stream_marks_run_interrupted(tiny, tmp_path):
    db = tmp_path / "t.db"
    stream = traced(tiny, db, "draft_model", "max_new_tokens=80").stream(prompt_ids=PROMPT)
    next(stream)
    stream.close()  # what the CLI's Ctrl-C or a playground Stop does to the generator
    run = TraceStore(db).list_runs()[0]
    assert run["status"] == "interrupted" and run["finished_at"] is not None


def test_database_failure_mid_run_does_not_break_the_decode(tiny, tmp_path, capfd):
    db = tmp_path / "t.db"
    pipe = traced(tiny, db)
    reference = make_pipeline(tiny, "draft_model", "strategy.propose.layers=1", "max_new_tokens=24", "trace=off")
    store = pipe.run_plugins[0].store

    def broken(*args, **kwargs):
        raise OSError("disk full")

    store.write_batch = broken
    store.finish_run = broken
    result = pipe(prompt_ids=PROMPT)
    assert result.token_ids == reference(prompt_ids=PROMPT).token_ids
    err = capfd.readouterr().err
    assert err.count("trace recording stopped") == 1 and "disk full" in err
    assert TraceStore(db).get_run(result.run_id)["status"] == "running"  # the row written at the start stays


def test_trace_off_adds_no_plugin():
    assert default_run_plugins(compose(["trace=off"])) == ()
