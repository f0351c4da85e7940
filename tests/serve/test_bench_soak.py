"""``python -m mtpflow.bench mode=soak`` (``mtpflow.tools.bench_soak``; its options are checked in test_bench_serve.py):
a run of a few seconds against a real server process on the tiny model writes its CSV, PNG and manifest and
computes every verdict (the thresholds are the 30-minute run's business: this machine is shared and noisy)."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from mtpflow.tools.bench_soak import main, minute_of, windows
from server_process import save_tiny_model


def test_minutes_scale_below_30():
    assert windows(30) == (60.0, 30) and windows(45) == (60.0, 45) and windows(0.3) == (pytest.approx(0.6), 30)
    assert minute_of(0.0, 0.3) == 0 and minute_of(1.25, 0.3) == 2 and minute_of(99.0, 0.3) == 29


def test_short_soak_writes_csv_png_manifest_and_verdicts(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    args = ["mode=soak", f"model={folder}", "minutes=0.3", "clients=2", "max_new_tokens=6", "cancel_share=0.5",
            f"out={out}"]
    assert main(args) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    table = pd.read_csv(out / "soak.csv")
    assert list(table["minute"]) == list(range(1, 31))
    assert table["answered"].sum() > 0 and table["failed"].sum() == 0
    assert table["answered_total"].iloc[-1] == table["answered"].sum()
    assert (table["rss_max_mb"].dropna() > 50).all()
    assert (out / "soak.png").stat().st_size > 0
    record = json.loads((out / "manifest.json").read_text())
    assert record["mode"] == "soak" and set(record["files"]) == {"soak.csv", "soak.png"}
    verdict = record["results"]["verdicts"]
    for key in ("memory_growth", "p99_growth"):
        assert isinstance(verdict[key], float) and not math.isnan(verdict[key]), (key, verdict)
    for key in ("memory_ok", "p99_ok", "failed_ok", "trace_rows_ok", "db_ok"):
        assert isinstance(verdict[key], bool), (key, verdict)
    # what does not depend on the host's speed holds even here
    assert verdict["failed_ok"] and verdict["trace_rows_ok"] and verdict["db_ok"], verdict
    assert verdict["db_integrity"] == "ok" and verdict["db_runs_missing"] == 0
    assert "must hold:" in printed


def test_a_database_the_restart_cannot_open_is_a_verdict_not_a_crash(tmp_path):
    from mtpflow.tools.bench_soak import reopen_after_kill

    folder = save_tiny_model(tmp_path / "tiny")
    db = tmp_path / "traces.db"
    db.write_bytes(b"this is not an SQLite database" * 200)
    found = reopen_after_kill(db, {1, 2}, [f"trace.db={db}", f"model.name={folder}"], tmp_path / "log", 120)
    assert found["db_intact"] is False and found["db_runs_missing"] == 2
    assert found["db_integrity"].startswith("not opened: the server did not start")
