"""``python -m mtpflow.traces``: list recorded runs, show one with its tokens colored by status (like
llama.cpp's ``--color``), export its token events as JSONL or CSV, compare two runs, print metrics, or serve
them to Prometheus. User mistakes print one line and exit 2.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

from mtpflow.errors import UserError

# ANSI styles per token status; emitted tokens get a background-free foreground so text stays readable.
STYLES = {
    "accepted": "\033[32m",  # green: a draft token the gate kept
    "recovered": "\033[33m",  # yellow: the target's token at the first rejected position
    "bonus": "\033[36m",  # cyan: the extra token after a fully accepted path
    "plain": "",  # default: an autoregressive step (no draft)
    "rejected": "\033[2;31;9m",  # dim red struck through (only with --all)
    "gated": "\033[35;9m",  # magenta struck through: the target agreed, the gate refused
    "deduped": "\033[35;2m",
    "pruned": "\033[2;90m",
}
RESET = "\033[0m"
EVENT_FIELDS = ["run_id", "step", "position", "node", "depth", "token_id", "token_text", "status", "emitted",
                "decided_by", "draft_prob", "target_prob", "pfs", "gate_score", "matches_target"]


def use_color(choice: str, stream=sys.stdout) -> bool:
    """auto: color only on a terminal and when NO_COLOR is unset (https://no-color.org)."""
    if choice == "always":
        return True
    if choice == "never" or os.environ.get("NO_COLOR"):
        return False
    return hasattr(stream, "isatty") and stream.isatty()


def open_store(path: str | None, must_exist: bool = True):
    from mtpflow.traces.store import TraceStore, default_db_path

    p = Path(os.path.expanduser(path)) if path else default_db_path()
    if must_exist and not p.exists():
        raise UserError(f"no trace database at {p} (decode something first, or pass --db PATH)")
    return TraceStore(p)


def resolve_run(store, run: str) -> int:
    if run in ("last", "latest"):
        run_id = store.last_run_id()
        if run_id is None:
            raise UserError(f"{store.path} holds no runs yet")
        return int(run_id)
    try:
        run_id = int(run)
    except ValueError:
        raise UserError(f"RUN must be a run id (see `python -m mtpflow.traces list`) or 'last', got {run!r}") from None
    if store.get_run(run_id) is None:
        raise UserError(f"no run {run_id} in {store.path}")
    return run_id


def status_label(run: dict) -> str:
    if run["status"] == "running" and run.get("alive") is False:
        return "running (process gone: killed?)"
    return run["status"]


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def cmd_list(store, args) -> int:
    runs = store.list_runs(limit=args.limit)
    if args.json:
        print(json.dumps(runs, default=str))
        return 0
    if not runs:
        print(f"no runs in {store.path}")
        return 0
    header = ("id", "started", "status", "strategy", "tokens", "MAL", "tok/s", "model", "prompt")
    rows = []
    for r in runs:
        stats = r["stats"] or {}
        tokens = stats.get("new_tokens", r.get("recorded_tokens"))
        prompt = " ".join(r["prompt"].split())
        rows.append((str(r["id"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started_at"])),
                     status_label(r), r["strategy"], _fmt(tokens), _fmt(stats.get("mal"), 2),
                     _fmt(stats.get("tokens_per_second"), 1), r["model_id"][:28],
                     prompt[:40] + ("…" if len(prompt) > 40 else "")))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def render_tokens(events: list[dict], color: bool, show_all: bool) -> str:
    """The output text with each token styled by its status; with ``show_all`` the refused draft tokens of
    each step follow its emitted tokens in ⟨⟩."""
    by_step: dict[int, list[dict]] = {}
    for e in events:
        by_step.setdefault(e["step"], []).append(e)
    out = []
    for step in sorted(by_step):
        evs = by_step[step]
        for e in sorted((e for e in evs if e["emitted"]), key=lambda e: e["position"]):
            style = STYLES.get(e["status"], "") if color else ""
            out.append(f"{style}{e['token_text']}{RESET}" if style else e["token_text"])
        refused = [e for e in evs if not e["emitted"] and e["status"] != "accepted"]
        if show_all and refused:
            refused.sort(key=lambda e: (e["node"] if e["node"] is not None else -1))
            parts = []
            for e in refused:
                style = STYLES.get(e["status"], "") if color else ""
                piece = e["token_text"].replace("\n", "\\n")
                parts.append(f"{style}{piece}{RESET}" if style else piece)
            out.append("⟨" + "|".join(parts) + "⟩")
    return "".join(out)


def legend(color: bool) -> str:
    names = ["accepted", "recovered", "bonus", "plain", "rejected", "gated", "deduped", "pruned"]
    if not color:
        return "statuses: " + ", ".join(names)
    return "legend: " + " ".join(f"{STYLES[n]}{n}{RESET}" if STYLES[n] else n for n in names)


def cmd_show(store, args) -> int:
    from mtpflow.traces.metrics import run_metrics

    run_id = resolve_run(store, args.run)
    run = store.get_run(run_id)
    events = store.token_events(run_id)
    color = use_color(args.color)
    print(f"run {run_id}  {run['strategy']} on {run['model_id']}  status: {status_label(run)}  "
          f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(run['started_at']))}")
    prompt = run["prompt"]
    print("prompt: " + (prompt if len(prompt) <= 300 else prompt[:300] + "…"))
    print()
    if args.tokens:
        print("step  pos  node depth  status     by       draft_p  target_p  pfs     gate    token")
        for e in events:
            print(f"{e['step']:>4} {e['position']:>4} {_fmt(e['node']):>5} {_fmt(e['depth']):>5}  "
                  f"{e['status']:<10} {e['decided_by']:<8} {_fmt(e['draft_prob']):>7}  {_fmt(e['target_prob']):>8}  "
                  f"{_fmt(e['pfs']):>6}  {_fmt(e['gate_score']):>6}  {json.dumps(e['token_text'], ensure_ascii=False)}")
    else:
        print(render_tokens(events, color, args.all))
        print()
        print(legend(color))
    m = run_metrics(store, run_id)
    print()
    keys = ["new_tokens", "verify_forwards", "mal", "acceptance_rate", "mtp_hit_rate", "mtp_avg_k_used",
            "mtp_error_propagation_rate", "time_to_first_token", "inter_token_latency_mean", "tokens_per_second"]
    for k in keys:
        print(f"  {k:<28} {_fmt(m[k], 4)}")
    print(f"  {'acceptance_by_position':<28} " + " ".join(f"{d}:{r:.2f}" for d, r in m["acceptance_by_position"].items()))
    print(f"  {'token statuses':<28} " + ", ".join(f"{k}={v}" for k, v in sorted(m["status_counts"].items())))
    return 0


def cmd_export(store, args) -> int:
    run_id = resolve_run(store, args.run)
    rows = store.token_events(run_id) if args.table == "events" else store.steps(run_id)
    fields = EVENT_FIELDS if args.table == "events" else [k for k in (rows[0] if rows else {}) if k != "id"]
    out = open(args.output, "w", newline="", encoding="utf-8") if args.output else sys.stdout
    try:
        if args.format == "jsonl":
            for r in rows:
                out.write(json.dumps({k: r[k] for k in fields}, ensure_ascii=False, default=str) + "\n")
        else:
            writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            for r in rows:
                writer.writerow({k: json.dumps(r[k]) if isinstance(r[k], dict) else r[k] for k in fields})
    finally:
        if out is not sys.stdout:
            out.close()
    if args.output:
        print(f"wrote {len(rows)} {args.table} of run {run_id} to {args.output}", file=sys.stderr)
    return 0


def compare_runs(store, a: int, b: int) -> dict:
    """Metrics of two runs side by side, and where their outputs first differ."""
    from mtpflow.traces.metrics import run_metrics

    ma, mb = run_metrics(store, a), run_metrics(store, b)

    def output(run_id):
        return [e["token_id"] for e in sorted((e for e in store.token_events(run_id) if e["emitted"]),
                                                key=lambda e: e["position"])]

    ta, tb = output(a), output(b)
    first_diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if first_diff is None and len(ta) != len(tb):
        first_diff = min(len(ta), len(tb))
    return {"a": ma, "b": mb, "same_output": ta == tb, "first_difference": first_diff}


def cmd_compare(store, args) -> int:
    a, b = resolve_run(store, args.run_a), resolve_run(store, args.run_b)
    cmp = compare_runs(store, a, b)
    if args.json:
        print(json.dumps(cmp, default=str))
        return 0
    ma, mb = cmp["a"], cmp["b"]
    keys = ["strategy", "status", "new_tokens", "verify_forwards", "mal", "acceptance_rate", "mtp_hit_rate",
            "mtp_avg_k_used", "mtp_error_propagation_rate", "time_to_first_token", "inter_token_latency_mean",
            "tokens_per_second"]
    print(f"  {'':<28} {'run ' + str(a):>14} {'run ' + str(b):>14}  b/a")
    for k in keys:
        va, vb = ma[k], mb[k]
        ratio = f"{vb / va:.2f}x" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else ""
        print(f"  {k:<28} {_fmt(va, 4):>14} {_fmt(vb, 4):>14}  {ratio}")
    depths = sorted(set(ma["acceptance_by_position"]) | set(mb["acceptance_by_position"]))
    for d in depths:
        print(f"  {'acceptance at position ' + str(d):<28} {_fmt(ma['acceptance_by_position'].get(d), 4):>14} "
              f"{_fmt(mb['acceptance_by_position'].get(d), 4):>14}")
    if cmp["same_output"]:
        print("  outputs: identical token ids")
    else:
        print(f"  outputs: differ from generated token {cmp['first_difference']}")
    return 0


def cmd_metrics(store, args) -> int:
    if args.run is None:
        from mtpflow.traces.metrics import exposition

        sys.stdout.write(exposition(store).decode())
        return 0
    from mtpflow.traces.metrics import run_metrics

    print(json.dumps(run_metrics(store, resolve_run(store, args.run)), default=str, indent=1))
    return 0


def cmd_serve(store, args) -> int:
    from mtpflow.traces.metrics import serve

    try:
        server = serve(store, args.port, args.host)
    except OSError as exc:
        raise UserError(f"cannot serve on {args.host}:{args.port}: {exc.strerror}") from None
    print(f"serving Prometheus metrics from {store.path} on http://{args.host}:{server.server_port}/metrics "
          "(Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mtpflow.traces", description="Inspect recorded decode traces.")
    p.add_argument("--db", help="trace database (default: <cache dir>/traces.db, as trace.db=null)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("list", help="recent runs with strategy, tokens, MAL, tok/s")
    s.add_argument("--limit", type=int, default=50)
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("show", help="a run's output colored by token status")
    s.add_argument("run", help="run id or 'last'")
    s.add_argument("--all", action="store_true", help="also show refused draft tokens after each step, in ⟨⟩")
    s.add_argument("--tokens", action="store_true", help="one line per token event instead of colored text")
    s.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    s = sub.add_parser("export", help="a run's token events (or steps) as JSONL or CSV")
    s.add_argument("run")
    s.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    s.add_argument("--table", choices=("events", "steps"), default="events")
    s.add_argument("-o", "--output", help="file to write (default: stdout)")
    s = sub.add_parser("compare", help="two runs side by side")
    s.add_argument("run_a")
    s.add_argument("run_b")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("metrics", help="Prometheus text for all runs, or one run's metrics as JSON")
    s.add_argument("run", nargs="?")
    s = sub.add_parser("serve", help="serve /metrics for Prometheus")
    s.add_argument("--port", type=int, default=9464)
    s.add_argument("--host", default="127.0.0.1")
    return p


COMMANDS = {"list": cmd_list, "show": cmd_show, "export": cmd_export, "compare": cmd_compare,
            "metrics": cmd_metrics, "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        store = open_store(args.db, must_exist=args.command != "serve")
        try:
            return COMMANDS[args.command](store, args)
        finally:
            store.close()
    except UserError as exc:
        print(f"mtpflow.traces: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
