"""The Gradio page: a prompt, strategies A and B, the common knobs and one button; both outputs stream side by
side with every token colored by what happened to it, a stats panel per side, the speedup of A over B, plots,
and a history tab over the trace store.

``build_blocks(runner)`` returns the ``gr.Blocks``; ``mtpflow.playground.server`` serves it with ``/metrics``.
"""
from __future__ import annotations

import html
import threading
import time

import gradio as gr

from mtpflow.errors import UserError

from mtpflow.playground import history, render
from mtpflow.playground.runner import (
    Knobs, PlaygroundRunner, example_prompts, parse_overrides, strategy_description, tunable_parameters,
)
from mtpflow.playground.views import SideView

DECODE_CONCURRENCY_ID = "decode"  # every event that decodes shares these slots; the engine batches their requests



def _side_summary(side: SideView | None) -> dict | None:
    if side is None:
        return None
    return {"strategy": side.strategy, "text": side.text, "stats": side.stats, "error": side.error,
            "run_id": side.run_id, "tokens": len(side.tokens), "first_token_seconds": side.first_token_seconds}


def _speedup(a: SideView | None, b: SideView | None) -> float | None:
    if a and b and a.stats and b.stats and b.stats.get("tokens_per_second"):
        return round(a.stats["tokens_per_second"] / b.stats["tokens_per_second"], 4)
    return None


def strategy_info(name: str) -> str:
    """The strategy's description and its tunable parameters (thresholds, n-gram sizes, ...) with defaults."""
    try:
        params = tunable_parameters(name)
    except UserError as exc:
        return str(exc)
    listing = f"\n```\n{params}\n```" if params else ""
    return f"**{html.escape(name)}**: {html.escape(strategy_description(name))}{listing}"


class ComparisonHandler:
    """The button's generator: validate, build both pipelines, decode A then B, yield page updates."""

    def __init__(self, runner: PlaygroundRunner):
        self.runner = runner

    def outputs(self, status, a, b, show_rejected, final: bool):
        summary = {"a": _side_summary(a), "b": _side_summary(b), "speedup": _speedup(a, b),
                   "status": status[1], "error": status[0]}
        updates = [
            render.status_html(status[1], error=status[0]),
            render.pane_html(a, show_rejected, "a"), render.pane_html(b, show_rejected, "b"),
            render.stats_markdown(a), render.stats_markdown(b), render.speedup_markdown(a, b),
        ]
        if final:
            updates += [render.comparison_figure(a, b), render.steps_table(a), render.steps_table(b), summary]
        else:  # plots and tables once at the end: re-sending them on every token costs more than it shows
            updates += [gr.skip(), gr.skip(), gr.skip(), gr.skip()]
        return updates

    def __call__(self, prompt, strategy_a, strategy_b, max_new_tokens, temperature, k, params_a, params_b,
                 show_rejected=True):
        t_request = time.perf_counter()
        try:
            if not str(prompt or "").strip():
                raise UserError("empty prompt: type a prompt or pick an example")
            knobs = Knobs.parse(max_new_tokens, temperature, k, max_tokens_cap=self.runner.max_tokens_cap)
            pipes = []
            for label, name, params in (("A", strategy_a, params_a), ("B", strategy_b, params_b)):
                try:
                    pipes.append(self.runner.build(str(name or ""), knobs, parse_overrides(params)))
                except UserError as exc:
                    raise UserError(f"strategy {label} ({name}): {exc}") from None
        except UserError as exc:
            yield self.outputs((True, str(exc)), None, None, show_rejected, final=True)
            return
        sides = [SideView(p.strategy_name) for p in pipes]
        cancel = threading.Event()
        try:
            # A and B decode at the same time, in one engine batch (with other visitors' requests)
            for _ in self.runner.run_sides(pipes, str(prompt), sides, t_request, cancel):
                running = [f"{'AB'[i]} ({s.strategy})" for i, s in enumerate(sides) if not s.done]
                msg = f"decoding {' and '.join(running)}…" if running else "finishing…"
                yield self.outputs((False, msg), sides[0], sides[1], show_rejected, final=False)
            failed = [f"{'AB'[i]} ({s.strategy}): {s.error}" for i, s in enumerate(sides) if s.error]
            if failed:
                status = (True, "strategy failed: " + "; ".join(failed))
            else:
                first = sides[0].first_token_seconds
                status = (False, f"done: first token {first:.2f} s after the request" if first is not None else "done")
            yield self.outputs(status, sides[0], sides[1], show_rejected, final=True)
        finally:
            cancel.set()  # the visitor left or the run ended: a decode still going stops at its next step


def build_blocks(runner: PlaygroundRunner) -> gr.Blocks:
    examples = example_prompts()
    strategies = runner.strategies()
    default_a = "pld" if "pld" in strategies else strategies[0]
    default_b = "baseline" if "baseline" in strategies else strategies[-1]
    example_labels = [f"{e.get('id', i)} · {e.get('class', '')}" for i, e in enumerate(examples)]
    handler = ComparisonHandler(runner)

    with gr.Blocks(title="mtpflow playground") as demo:
        gr.Markdown(f"## mtpflow playground\nTwo strategies, one model ({html.escape(runner.loaded.model_id)}), "
                    "side by side: every token is colored by what happened to it.")
        with gr.Tab("Compare"):
            with gr.Row():
                with gr.Column(scale=3):
                    prompt = gr.Textbox(label="Prompt", lines=4, value=examples[0]["prompt"] if examples else "",
                                        elem_id="prompt")
                    example = gr.Dropdown(example_labels, label="Benchmark prompts", value=None,
                                          info="pick one to fill the prompt")
                with gr.Column(scale=2):
                    with gr.Row():
                        strategy_a = gr.Dropdown(strategies, value=default_a, label="Strategy A")
                        strategy_b = gr.Dropdown(strategies, value=default_b, label="Strategy B")
                    with gr.Row():
                        max_new_tokens = gr.Number(value=min(128, runner.max_tokens_cap), precision=0,
                                                   label="Max new tokens", elem_id="knob-max-new-tokens")
                        # text boxes, not gr.Number: a blank Number shows and sends 0, and blank must mean
                        # "the strategy's own value" (K = 0 would turn every strategy into plain decoding)
                        temperature = gr.Textbox("", label="Temperature", placeholder="strategy default",
                                                 info="blank: the strategy's own (greedy for most)",
                                                 elem_id="knob-temperature")
                        k = gr.Textbox("", label="K", placeholder="strategy default",
                                       info="blank: the strategy's own K", elem_id="knob-k")
                    show_rejected = gr.Checkbox(value=True, label="Show rejected drafts inline")
            with gr.Accordion("Strategy parameters (thresholds, n-gram sizes, …)", open=False):
                with gr.Row():
                    with gr.Column():
                        info_a = gr.Markdown(strategy_info(default_a))
                        params_a = gr.Textbox("", lines=3, label="A overrides",
                                              info="key=value lines, e.g. one of the parameters above")
                    with gr.Column():
                        info_b = gr.Markdown(strategy_info(default_b))
                        params_b = gr.Textbox("", lines=3, label="B overrides",
                                              info="key=value lines, e.g. one of the parameters above")
            with gr.Row():
                run = gr.Button("Compare", variant="primary", elem_id="compare-button")
                stop = gr.Button("Stop", variant="stop")
            status = gr.HTML(render.status_html("ready"), elem_id="status")
            gr.HTML(render.legend_html())
            with gr.Row(equal_height=False):
                with gr.Column():
                    gr.Markdown("### A")
                    pane_a = gr.HTML(render.pane_html(None, elem="a"), elem_id="pane-a")
                    stats_a = gr.Markdown(elem_id="stats-a")
                with gr.Column():
                    gr.Markdown("### B")
                    pane_b = gr.HTML(render.pane_html(None, elem="b"), elem_id="pane-b")
                    stats_b = gr.Markdown(elem_id="stats-b")
            speedup = gr.Markdown(elem_id="speedup")
            plot = gr.Plot(label="Accepted length, K, acceptance by position", elem_id="plot")
            with gr.Accordion("Steps: K, draft sizes, accepted length, rejected drafts", open=False):
                with gr.Row():
                    steps_a = gr.Dataframe(headers=render.STEP_HEADERS, label="A steps", wrap=True)
                    steps_b = gr.Dataframe(headers=render.STEP_HEADERS, label="B steps", wrap=True)
            with gr.Accordion("Raw result (JSON)", open=False):
                summary = gr.JSON(label="summary")

            outputs = [status, pane_a, pane_b, stats_a, stats_b, speedup, plot, steps_a, steps_b, summary]
            inputs = [prompt, strategy_a, strategy_b, max_new_tokens, temperature, k, params_a, params_b,
                      show_rejected]
            def compare(prompt, strategy_a, strategy_b, max_new_tokens, temperature, k, params_a, params_b,
                        show_rejected=True):
                # a plain generator function: Gradio streams only what it sees as one
                yield from handler(prompt, strategy_a, strategy_b, max_new_tokens, temperature, k, params_a,
                                   params_b, show_rejected)

            # several visitors at once: their requests join the one engine's batch (max_batch_size sequences)
            run_event = run.click(compare, inputs, outputs, api_name="compare", concurrency_limit=4,
                                  concurrency_id=DECODE_CONCURRENCY_ID)
            stop.click(None, None, None, cancels=[run_event], api_visibility="private")

            def pick_example(label):
                if label in example_labels:
                    return examples[example_labels.index(label)]["prompt"]
                return gr.skip()

            example.change(pick_example, example, prompt, api_visibility="private")

            def on_strategy(name):
                # the overrides box is emptied: overrides typed for the previous strategy rarely fit the new one
                return strategy_info(name), ""

            strategy_a.change(on_strategy, strategy_a, [info_a, params_a], api_visibility="private")
            strategy_b.change(on_strategy, strategy_b, [info_b, params_b], api_visibility="private")

        refresh = history.build_tab(runner.trace_store(), runner.loaded.tokenizer, runner.loaded.model_id)
        if refresh is not None:
            list_runs, runs_table = refresh
            demo.load(list_runs, None, runs_table, api_visibility="private")
            # a finished comparison adds two runs: show them without a manual refresh
            run_event.then(list_runs, None, runs_table, api_visibility="private")
    demo.queue(max_size=64, default_concurrency_limit=4)
    return demo
