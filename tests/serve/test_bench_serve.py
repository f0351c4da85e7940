"""``python -m mtpflow.bench mode=serve`` (``mtpflow.tools.bench_serve``): options checked before anything starts (for
``mode=soak`` too), and a small run against a real server process on the tiny model writes its table, CSV and PNG."""
from __future__ import annotations

import pandas as pd
import pytest

from mtpflow.tools.bench import main as bench_main
from mtpflow.tools.bench_serve import main, percentile
from server_process import save_tiny_model


@pytest.mark.parametrize("mode,args,message", [
    ("serve", ["concurrency=[0]"], "concurrency"),
    ("serve", ["requests=0"], "requests"),
    ("serve", ["strategies=[warp]"], "unknown strategy"),
    ("serve", ["strategies=[]"], "strategies"),
    ("serve", ["concurency=[1]"], "unknown option"),
    ("soak", ["minutes=0"], "minutes"),
    ("soak", ["clients=0"], "clients"),
    ("soak", ["strategies=[warp]"], "unknown strategy"),
    ("soak", ["cancel_share=2"], "cancel_share"),
    ("soak", ["client=2"], "unknown option"),
])
def test_options_are_checked_first(mode, args, message, tmp_path, capsys):
    """Both server benches (``mode=soak`` parses its options with this module's ``parse_options``), through
    ``python -m mtpflow.bench``'s own dispatch."""
    assert bench_main([f"mode={mode}", f"out={tmp_path}", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_percentile():
    assert percentile([3, 1, 2], 0.5) == 2 and percentile([1, 2], 0.95) == pytest.approx(1.95)


def test_small_run_writes_csv_and_png(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    args = ["mode=serve", f"model={folder}", "strategies=[baseline,pld]", "concurrency=[1,2]", "requests=2",
            "max_new_tokens=4", "limit=1", f"out={out}"]
    assert main(args) == 0, capsys.readouterr().err[-2000:]
    table = pd.read_csv(out / "serve_bench.csv")
    assert list(table["strategy"]) == ["baseline", "baseline", "pld", "pld"]
    assert list(table["concurrency"]) == [1, 2, 1, 2]
    assert (table["output_tokens"] == 8).all() and (table["identical"] == "2/2").all()
    for column in ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "latency_p50_ms",
                   "latency_p95_ms"):
        assert (table[column] > 0).all()
    assert (out / "serve_bench.png").stat().st_size > 0
