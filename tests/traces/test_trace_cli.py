"""``python -m mtpflow.traces`` (list, show colors, export formats, compare, metrics, the exporter) and the
main CLI's one-line errors for a bad trace database."""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtpflow.traces import TraceStore
from mtpflow.traces.cli import main
from test_trace_recorder import PROMPT, traced


@pytest.fixture(scope="module")
def recorded(tiny, tmp_path_factory):
    db = tmp_path_factory.mktemp("cli") / "t.db"
    a = traced(tiny, db, "draft_model")(prompt_ids=PROMPT)
    b = traced(tiny, db, "jacobi")(prompt_ids=PROMPT)
    return db, a, b


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list(recorded, capsys):
    db, a, b = recorded
    code, out, _ = run_cli(capsys, "--db", str(db), "list")
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].split()[:4] == ["id", "started", "status", "strategy"]
    assert lines[1].split()[0] == str(b.run_id) and "jacobi" in lines[1] and "complete" in lines[1]
    code, out, _ = run_cli(capsys, "--db", str(db), "list", "--json")
    assert [r["id"] for r in json.loads(out)] == [b.run_id, a.run_id]


def test_show_colors_only_when_asked_or_on_a_terminal(recorded, capsys, monkeypatch):
    db, a, _ = recorded
    code, out, _ = run_cli(capsys, "--db", str(db), "show", str(a.run_id), "--color", "always")
    assert code == 0 and "\033[32m" in out and "\033[33m" in out  # accepted green, recovered yellow
    code, out, _ = run_cli(capsys, "--db", str(db), "show", str(a.run_id))  # captured stdout is not a tty
    assert "\033[" not in out and a.text.strip()[:10] in out
    monkeypatch.setenv("NO_COLOR", "1")
    code, out, _ = run_cli(capsys, "--db", str(db), "show", "last", "--all")
    assert "\033[" not in out and "⟨" in out and "mal" in out
    code, out, _ = run_cli(capsys, "--db", str(db), "show", str(a.run_id), "--tokens")
    assert out.count("accepted") >= 1 and "prefill" in out


def test_export_jsonl_and_csv(recorded, capsys, tmp_path):
    db, a, _ = recorded
    events = TraceStore(db).token_events(a.run_id)
    code, out, _ = run_cli(capsys, "--db", str(db), "export", str(a.run_id), "--format", "jsonl")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == len(events) and rows[0]["run_id"] == a.run_id
    emitted = sorted((r for r in rows if r["emitted"]), key=lambda r: r["position"])
    assert [r["token_id"] for r in emitted] == a.token_ids
    path = tmp_path / "events.csv"
    code, _, err = run_cli(capsys, "--db", str(db), "export", str(a.run_id), "--format", "csv", "-o", str(path))
    table = list(csv.DictReader(io.StringIO(path.read_text())))
    assert code == 0 and len(table) == len(events) and {"status", "token_text", "pfs"} <= set(table[0])
    code, out, _ = run_cli(capsys, "--db", str(db), "export", str(a.run_id), "--table", "steps", "--format", "csv")
    assert len(list(csv.DictReader(io.StringIO(out)))) == len(a.steps)


def test_compare(recorded, capsys):
    db, a, b = recorded
    code, out, _ = run_cli(capsys, "--db", str(db), "compare", str(a.run_id), str(b.run_id), "--json")
    cmp = json.loads(out)
    assert code == 0 and cmp["a"]["strategy"] == "draft_model" and cmp["b"]["strategy"] == "jacobi"
    assert cmp["same_output"] == (a.token_ids == b.token_ids)  # both lossless: True
    assert cmp["a"]["mal"] == a.stats["mal"] and cmp["b"]["verify_forwards"] == b.stats["verify_forwards"]
    code, out, _ = run_cli(capsys, "--db", str(db), "compare", str(a.run_id), str(b.run_id))
    assert "mal" in out and "outputs:" in out


def test_unknown_run_and_missing_db_exit_2(recorded, capsys, tmp_path):
    db, _, _ = recorded
    assert run_cli(capsys, "--db", str(db), "show", "999")[0] == 2
    code, _, err = run_cli(capsys, "--db", str(tmp_path / "none.db"), "list")
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_prometheus_exposition_parses(recorded, capsys):
    db, a, b = recorded
    code, out, _ = run_cli(capsys, "--db", str(db), "metrics")
    families = {f.name: f for f in text_string_to_metric_families(out)}
    draft = {s.labels["strategy"]: s.value for s in families["mtpflow_spec_decode_num_draft_tokens"].samples}
    assert draft["draft_model"] == a.stats["draft_tokens"] and draft["jacobi"] == b.stats["draft_tokens"]
    acc = {s.labels["strategy"]: s.value for s in families["mtpflow_spec_decode_num_accepted_tokens"].samples}
    assert acc["draft_model"] == a.stats["accepted_tokens"]
    per_pos = families["mtpflow_spec_decode_num_accepted_tokens_per_pos"].samples
    assert sum(s.value for s in per_pos if s.labels["strategy"] == "draft_model") == a.stats["accepted_tokens"]
    hit = {s.labels["strategy"]: s.value for s in families["mtp_hit_rate"].samples}
    assert hit["draft_model"] == pytest.approx(a.stats["mtp_hit_rate"], abs=1e-4)
    assert families["mtpflow_inter_token_latency_seconds"].type == "histogram"
    ttft = [s for s in families["mtpflow_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert sum(s.value for s in ttft) == 2
    code, out, _ = run_cli(capsys, "--db", str(db), "metrics", str(a.run_id))
    assert json.loads(out)["mal"] == a.stats["mal"]


def test_exporter_serves_metrics(recorded):
    from mtpflow.traces.metrics import serve

    db, _, _ = recorded
    server = serve(TraceStore(db), 0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30).read().decode()
    finally:
        server.shutdown()
    assert "mtpflow_spec_decode_num_draft_tokens_total" in body


@pytest.mark.parametrize("kind", ["not_sqlite", "unwritable"])
def test_main_cli_bad_trace_db_is_one_line_exit_2(tmp_path, kind):
    if kind == "not_sqlite":
        bad = tmp_path / "traces.db"
        bad.write_text("hello")
    else:
        (tmp_path / "file").write_text("x")
        bad = tmp_path / "file" / "traces.db"
    proc = subprocess.run([sys.executable, "-m", "mtpflow", "prompt=hi", f"trace.db={bad}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "trace=off" in proc.stderr


@pytest.mark.default_model
def test_trace_off_still_decodes_with_a_bad_trace_db(tmp_path):
    bad = tmp_path / "traces.db"
    bad.write_text("hello")
    proc = subprocess.run([sys.executable, "-m", "mtpflow", "prompt=Say hi", "max_new_tokens=4", "output=json",
                           "trace=off", f"trace.db={bad}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["new_tokens"] >= 1 and bad.read_text() == "hello"
