"""Trace retention and sampling: caps on runs, age and size delete the oldest finished runs whole (never a
running one), the size cap holds with a writer and the retention thread at work, and ``trace.sample`` keeps
run rows and steps of every run but the token events of only the sampled share."""
from __future__ import annotations

import sqlite3
import time

import pytest

from mtpflow.config import compose
from mtpflow.errors import ConfigError
from mtpflow.traces.recorder import events_sampled, recorder_from_config
from mtpflow.traces.retention import TraceRetention
from mtpflow.traces.store import TraceStore


def add_run(store, status="complete", events=32, started_at=None, text_bytes=2000):
    run_id = store.start_run(strategy="pld", config={"pad": "x" * text_bytes}, model_id="m", prompt="p",
                             prompt_tokens=2, package_version="0", started_at=started_at)
    steps = [dict(run_id=run_id, step=i, k=4, num_proposed=4, num_kept=3, accepted_length=2, num_emitted=3,
                  bonus=False, forward_seconds=0.1, step_seconds=0.12, time_since_start=0.2 * i,
                  stage_seconds='{"verify": 0.1}') for i in range(8)]
    rows = [dict(run_id=run_id, step=i // 4, position=i, node=0, depth=1, token_id=10, token_text="t",
                 status="accepted", emitted=True, decided_by="gate") for i in range(events)]
    if status == "running":
        store.write_batch(steps, rows)
    else:
        store.finish_run(run_id, status, output_text="o", stats={"new_tokens": 8}, steps=steps, events=rows)
    return run_id


def ids(store):
    return [r["id"] for r in store.list_runs(limit=10_000)][::-1]


def test_max_runs_keeps_the_newest_and_never_a_running_run(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    running = add_run(store, status="running")
    finished = [add_run(store) for _ in range(6)]
    retention = TraceRetention(store, max_runs=3)
    assert retention.enforce() == 4
    assert ids(store) == [running, *finished[-2:]]
    assert store.count("steps") == 3 * 8 and store.count("token_events") == 3 * 32
    retention.run_finished()  # inline (no thread): nothing more to delete
    assert retention.deleted == 4


def test_max_age_deletes_old_finished_runs(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    old = [add_run(store, started_at=time.time() - 7200) for _ in range(3)]
    stale_running = add_run(store, status="running", started_at=time.time() - 7200)
    new = add_run(store)
    TraceRetention(store, max_age_hours=1).enforce()
    assert ids(store) == [stale_running, new]
    assert old  # deleted whole: no orphan rows
    con = sqlite3.connect(tmp_path / "t.db")
    assert con.execute("SELECT count(*) FROM token_events WHERE run_id NOT IN (SELECT id FROM runs)").fetchone() == (0,)


def test_size_cap_holds_with_a_writer_and_the_retention_thread(tmp_path):
    db = tmp_path / "t.db"
    store = TraceStore(db)
    retention = TraceRetention(store, max_mb=0.5)
    retention.start(interval_seconds=0.5)
    cap, peak = 0.5 * (1 << 20), 0
    try:
        for _ in range(300):  # about 12 kB each: 3.6 MB without retention
            add_run(store, events=64, text_bytes=4000)
            retention.run_finished()
            peak = max(peak, store.file_bytes())
    finally:
        retention.stop()
    assert peak <= cap, peak
    assert retention.deleted > 200 and store.count("runs") == 300 - retention.deleted
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert ids(store)[-1] == 300  # the newest kept


def test_retention_settings_are_checked(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    for kwargs, message in [({"max_runs": 0}, "max_runs"), ({"max_age_hours": -1}, "max_age_hours"),
                            ({"max_mb": "big"}, "max_mb"), ({"max_mb": 0.01}, "at least 0.25")]:
        with pytest.raises(ConfigError, match=message):
            TraceRetention(store, **kwargs)
    cfg = compose([f"trace.db={tmp_path / 't.db'}", "+trace.retention.max_rows=5"])
    with pytest.raises(ConfigError, match="unknown trace.retention setting"):
        recorder_from_config(cfg.trace)
    with pytest.raises(ConfigError, match="trace.sample"):
        recorder_from_config(compose([f"trace.db={tmp_path / 't.db'}", "trace.sample=1.5"]).trace)
    assert not TraceRetention(store).active


def test_events_sampled_spreads_evenly():
    assert all(events_sampled(i, 1.0) for i in range(1, 100)) and not any(events_sampled(i, 0) for i in range(1, 100))
    for rate in (0.1, 0.25, 0.5):
        share = sum(events_sampled(i, rate) for i in range(1, 1001)) / 1000
        assert abs(share - rate) < 0.02
        window = sum(events_sampled(i, rate) for i in range(501, 541)) / 40  # any window, not just the whole
        assert abs(window - rate) < 0.1


def test_sampled_out_runs_keep_their_run_row_and_steps(tiny, tmp_path):
    from helpers import make_pipeline

    db = tmp_path / "t.db"
    cfg = compose(["strategy=pld", f"trace.db={db}", "trace.sample=0"])
    factory = recorder_from_config(cfg.trace)
    pipe = make_pipeline(tiny, "pld", f"trace.db={db}", "max_new_tokens=12", run_plugins=(factory,))
    result = pipe(prompt_ids=[5, 6, 7, 8, 5, 6, 7, 8])
    store = TraceStore(db)
    run = store.get_run(result.run_id)
    assert run["status"] == "complete" and run["stats"]["trace_events_sampled"] is False
    assert len(store.steps(result.run_id)) == len(result.steps) > 0
    assert store.count("token_events", result.run_id) == 0
    factory_all = recorder_from_config(compose([f"trace.db={db}"]).trace)
    pipe = make_pipeline(tiny, "pld", f"trace.db={db}", "max_new_tokens=12", run_plugins=(factory_all,))
    again = pipe(prompt_ids=[5, 6, 7, 8, 5, 6, 7, 8])
    assert store.count("token_events", again.run_id) > 0
    assert "trace_events_sampled" not in store.get_run(again.run_id)["stats"]
