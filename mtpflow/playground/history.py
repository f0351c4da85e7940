"""The history tab: past runs from the SQLite trace store (``mtpflow.traces.TraceStore``), reopened with the
same colored token view as the live comparison, and any two compared side by side.

Runs are recorded by the trace run plugin (``mtpflow.plugins.manager.default_run_plugins``), so every comparison
made on the page (and every CLI or benchmark run on the same database) shows up here.
"""
from __future__ import annotations

import time

import gradio as gr

from mtpflow.types import ACCEPTED

from mtpflow.playground import render
from mtpflow.playground.views import (
    IncrementalDetokenizer, RejectedDraft, SideView, StepView, TokenView, finish_tokens,
)

RUN_HEADERS = ["run", "started (UTC)", "status", "strategy", "tokens", "MAL", "tokens/s", "prompt"]
EMITTED_KINDS = ("accepted", "recovered", "bonus", "plain")


def runs_table(store, limit: int = 50) -> list[list]:
    rows = []
    for r in store.list_runs(limit=limit):
        stats = r.get("stats") or {}
        prompt = " ".join(str(r.get("prompt") or "").split())
        rows.append([
            r["id"], time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["started_at"])), r["status"], r["strategy"],
            stats.get("new_tokens", r.get("recorded_tokens", "")), stats.get("mal", ""),
            stats.get("tokens_per_second", ""), prompt[:80] + ("…" if len(prompt) > 80 else ""),
        ])
    return rows


def side_from_trace(store, run_id: int, tokenizer=None, model_id: str | None = None) -> SideView:
    """A SideView rebuilt from a recorded run: emitted tokens in order, refused drafts per step, stats.

    The recorder stores each token's text decoded on its own; when the run used this process's model the text
    is decoded again in sequence, so characters split across tokens read correctly.
    """
    run = store.get_run(int(run_id))
    if run is None:
        raise KeyError(f"no run {run_id} in the trace database")
    side = SideView(strategy=run["strategy"], run_id=run["id"], stats=run.get("stats") or {},
                    text=run.get("output_text") or "", done=True)
    if run["status"] != "complete":
        side.error = f"run is {run['status']}" + (" (its process is gone)" if run.get("alive") is False else "")
    events = store.token_events(run["id"])
    emitted = sorted((e for e in events if e["emitted"] and e["status"] in EMITTED_KINDS),
                     key=lambda e: (e["step"], e["position"]))
    detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None and model_id == run["model_id"] else None
    for e in emitted:
        text = detok.push(e["token_id"]) if detok else (e["token_text"] or "")
        side.tokens.append(TokenView(
            token_id=e["token_id"], text=text, kind=e["status"], step=e["step"], depth=e["depth"],
            draft_prob=e["draft_prob"], target_prob=e["target_prob"], pfs=e["pfs"], gate_score=e["gate_score"]))
    if detok:
        finish_tokens(side.tokens, detok)
    rejected: dict[int, list[RejectedDraft]] = {}
    max_depth: dict[int, int] = {}
    for e in events:
        if e["depth"] is not None:
            max_depth[e["step"]] = max(max_depth.get(e["step"], 0), e["depth"])
        if not e["emitted"] and e["depth"] is not None and e["status"] != ACCEPTED:
            rejected.setdefault(e["step"], []).append(RejectedDraft(
                depth=e["depth"], text=e["token_text"] or "", status=e["status"], draft_prob=e["draft_prob"],
                target_prob=e["target_prob"], pfs=e["pfs"], gate_score=e["gate_score"]))
    for s in store.steps(run["id"]):
        side.steps.append(StepView(
            step=s["step"], k=s["k"], proposed=s["num_proposed"], kept=s["num_kept"],
            accepted=s["accepted_length"], emitted=s["num_emitted"], max_depth=max_depth.get(s["step"], 0),
            rejected=tuple(rejected.get(s["step"], ())), forward_seconds=s["forward_seconds"]))
    return side


def _run_id(value) -> int | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"run ids are integers, got {value!r}") from None
    if not v.is_integer() or v < 1:
        raise ValueError(f"run ids are positive integers, got {value!r}")
    return int(v)


def build_tab(store, tokenizer=None, model_id: str | None = None):
    """Add the History tab to the Blocks being built (``store`` None: tracing is off); returns the
    (refresh function, runs table) pair for the page's load event, or None."""

    with gr.Tab("History"):
        if store is None:
            gr.Markdown("Trace recording is off (`trace=off`), so there is no history to show.")
            return None
        gr.Markdown(f"Runs recorded in `{store.path}` (newest first). Click a row to load it into A "
                    "(the previous A moves to B), or type two run ids.")
        with gr.Row():
            refresh = gr.Button("Refresh", size="sm")
            run_a = gr.Textbox("", label="Run A", placeholder="run id", elem_id="history-run-a")
            run_b = gr.Textbox("", label="Run B (optional)", placeholder="run id", elem_id="history-run-b")
            open_btn = gr.Button("Open / compare", variant="primary", elem_id="history-open")
        runs = gr.Dataframe(headers=RUN_HEADERS, label="Past runs", interactive=False, elem_id="history-runs",
                            max_height=320)
        status = gr.HTML(elem_id="history-status")
        with gr.Row(equal_height=False):
            with gr.Column():
                pane_a = gr.HTML(elem_id="history-pane-a")
                stats_a = gr.Markdown(elem_id="history-stats-a")
            with gr.Column():
                pane_b = gr.HTML(elem_id="history-pane-b")
                stats_b = gr.Markdown(elem_id="history-stats-b")
        speedup = gr.Markdown()
        plot = gr.Plot(label="Accepted length, K, acceptance by position")

        def list_runs():
            try:
                return runs_table(store)
            except Exception as exc:  # a damaged database must not break the page
                gr.Warning(f"cannot read the trace database: {exc}")
                return []

        def open_runs(a, b):
            try:
                ids = [_run_id(a), _run_id(b)]
                if ids[0] is None and ids[1] is None:
                    raise ValueError("type a run id (or click a row of the table)")
                sides = [None if i is None else side_from_trace(store, i, tokenizer, model_id) for i in ids]
            except (ValueError, KeyError) as exc:
                msg = exc.args[0] if exc.args else str(exc)
                return [render.status_html(str(msg), error=True), "", "", "", "", "", None]
            a_side, b_side = sides
            return [render.status_html("opened " + ", ".join(f"run {i}" for i in ids if i is not None)),
                    render.pane_html(a_side, True, "history-a") if a_side else "",
                    render.pane_html(b_side, True, "history-b") if b_side else "",
                    render.stats_markdown(a_side), render.stats_markdown(b_side),
                    render.speedup_markdown(a_side, b_side), render.comparison_figure(a_side, b_side)]

        def pick_row(current_a, evt: gr.SelectData):
            row = evt.row_value if evt.row_value else None
            if not row:
                return gr.skip(), gr.skip()
            return str(row[0]), current_a

        outputs = [status, pane_a, pane_b, stats_a, stats_b, speedup, plot]
        refresh.click(list_runs, None, runs, api_name="history_runs")
        open_btn.click(open_runs, [run_a, run_b], outputs, api_name="history_open")
        runs.select(pick_row, run_a, [run_a, run_b], api_visibility="private")
        return list_runs, runs
