"""The playground's model-side work: validate the page's knobs, build one ``Pipeline`` per strategy on the
one shared engine, and run the two decodes of a comparison at the same time while streaming snapshots.

One process holds one model and one ``mtpflow.engine.Engine``: A and B of a comparison, and the comparisons
of several visitors, are requests of that engine and decode together in its batch (each sequence with its
own KV cache slot and stage objects), so nobody waits for another visitor's whole run.
"""
from __future__ import annotations

import copy
import json
import queue
import re
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Iterator

from mtpflow.api import Pipeline
from mtpflow.config import available_strategies, compose
from mtpflow.engine import Engine
from mtpflow.errors import ConfigError, UserError, check_int
from mtpflow.model import load_configured
from mtpflow.plugins.manager import default_run_plugins

from mtpflow.playground.views import IncrementalDetokenizer, SideView, finish_tokens, step_tokens, step_view

# Keys a page visitor may override: strategy parameters and sampling knobs. Never ``_target_`` (arbitrary
# code), model paths or prompt files (server files), or interpolations (environment variables).
_OVERRIDE_KEY = re.compile(r"^(strategy(\.[A-Za-z0-9][A-Za-z0-9_]*)+|top_k|top_p|seed|stop|chat|system_prompt)$")
_FORBIDDEN_LEAVES = ("model", "path", "file", "dir")
FALLBACK_EXAMPLES = (
    {"id": "summarize", "class": "summarize/extract",
     "prompt": "Summarize in one sentence: The meeting moved from Tuesday to Thursday at 3 pm because the client "
               "asked for more time to review the proposal. Please update your calendars."},
    {"id": "code", "class": "code", "prompt": "Write a Python function that returns the n-th Fibonacci number."},
    {"id": "chat", "class": "open chat", "prompt": "Give me three tips for staying focused while working."},
)


def example_prompts(limit_per_class: int = 2) -> list[dict]:
    """A few prompts per class from the benchmark suite (``mtpflow/data/bench_prompts.jsonl``), or built-ins."""
    try:
        text = resources.files("mtpflow.data").joinpath("bench_prompts.jsonl").read_text("utf-8")
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError):
        rows = []
    rows = [r for r in rows if isinstance(r, dict) and str(r.get("prompt", "")).strip()]
    if not rows:
        return list(FALLBACK_EXAMPLES)
    seen: dict[str, int] = {}
    kept = []
    for r in rows:
        cls = str(r.get("class", ""))
        seen[cls] = seen.get(cls, 0) + 1
        if seen[cls] <= limit_per_class:
            kept.append(r)
    return kept


@dataclass(frozen=True)
class Knobs:
    """The common knobs of both sides, checked before anything runs."""

    max_new_tokens: int
    temperature: float | None  # None keeps each strategy's own temperature
    k: int | None  # None keeps each strategy's own K
    seed: int = 0

    @staticmethod
    def parse(max_new_tokens, temperature, k, seed=0, max_tokens_cap: int = 1024) -> "Knobs":
        mnt = check_int("max new tokens", max_new_tokens, 1, max_tokens_cap)
        temp = _number("temperature", temperature)
        if temp is not None and not 0 <= temp <= 5:
            raise ConfigError(f"temperature must be blank (the strategy's own) or in [0, 5], got {temperature!r}")
        blank_k = k is None or (isinstance(k, str) and not k.strip())  # blank: the strategy's own K
        kk = None if blank_k else check_int("K", k, 0, 64)
        sd = check_int("seed", seed)
        return Knobs(mnt, None if temp is None else float(temp), kk, sd)

    def overrides(self) -> list[str]:
        out = [f"max_new_tokens={self.max_new_tokens}", f"seed={self.seed}"]
        if self.temperature is not None:
            out.append(f"temperature={self.temperature}")
        if self.k is not None:
            out.append(f"k={self.k}")
        return out


def _number(name: str, value) -> float | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return v


def parse_overrides(text: str | None) -> list[str]:
    """``key=value`` pairs (spaces or newlines between them) that a visitor may set; ConfigError otherwise."""
    out = []
    for item in (text or "").split():
        key, sep, value = item.partition("=")
        key = key.lstrip("+")
        leaf = key.rsplit(".", 1)[-1]
        if not sep or not _OVERRIDE_KEY.match(key) or any(leaf.endswith(w) for w in _FORBIDDEN_LEAVES):
            raise ConfigError(f"override {item!r} is not allowed here (use strategy.<stage>.<param>=value, "
                              "top_k, top_p, seed, stop, chat or system_prompt)")
        if "${" in value:
            raise ConfigError(f"override {item!r}: interpolations are not allowed here")
        out.append(f"{key}={value}")
    return out


def tunable_parameters(strategy: str) -> str:
    """The strategy's scalar stage parameters as editable ``key=value`` lines (thresholds, n-gram sizes, ...)."""
    from omegaconf import DictConfig, ListConfig

    cfg = compose([f"strategy={strategy}"]).strategy
    lines = []

    def walk(node, path):
        if isinstance(node, DictConfig):
            for key in node:
                if not str(key).startswith("_"):
                    walk(node[key], f"{path}.{key}")
        elif isinstance(node, ListConfig):
            for i, item in enumerate(node):
                walk(item, f"{path}.{i}")
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            leaf = path.rsplit(".", 1)[-1]
            if not any(leaf.endswith(w) for w in _FORBIDDEN_LEAVES):
                lines.append(f"{path}={node}")

    for stage in ("select_k", "propose", "prune", "gate", "dedup", "rescore", "window"):
        node = cfg.get(stage)
        if node is not None:
            walk(node, f"strategy.{stage}")
    return "\n".join(lines)


def strategy_description(strategy: str) -> str:
    try:
        cfg = compose([f"strategy={strategy}"]).strategy
    except UserError as exc:
        return str(exc)
    lossless = "lossless" if cfg.get("lossless") else "lossy"
    return f"{cfg.get('description', '')} ({lossless})"


class PlaygroundRunner:
    """Holds the one model of this process and runs comparisons on it."""

    def __init__(self, base_overrides: tuple[str, ...] = (), loaded=None, max_tokens_cap: int = 1024):
        self.base_overrides = tuple(base_overrides)
        self.max_tokens_cap = max_tokens_cap
        # batch_k=off: A and B share a batch, yet each side drafts as its strategy would alone, so the comparison
        # shows the strategies and not the engine's batch-wide draft cap (a visitor's override still wins)
        base = compose(["batch_k=off", *self.base_overrides])
        m = base.model
        self.loaded = loaded or load_configured(m)
        self.defaults = base
        self.engine = Engine(base, loaded=self.loaded)  # every comparison's requests decode in its batch
        self._cache_lock = threading.Lock()
        self._configs: dict[tuple[str, ...], object] = {}
        # Run plugins (the trace recorder and its open database) depend on the run-level config only, which
        # visitors cannot override: build them once, not once per request.
        self.run_plugins = default_run_plugins(base)

    def trace_store(self):
        """The trace database the run plugins record into, or None when tracing is off."""
        for factory in self.run_plugins:
            store = getattr(factory, "store", None)
            if store is not None:
                return store
        return None

    def _compose(self, overrides: tuple[str, ...]):
        """Hydra's compose is slow next to a lookup, and a page asks for the same few configs again and again
        (measured: docs/bench/code-figures.md#playground-runner-_compose)."""
        with self._cache_lock:
            cfg = self._configs.get(overrides)
        if cfg is None:
            cfg = compose(list(overrides))
            with self._cache_lock:
                if len(self._configs) > 256:
                    self._configs.clear()
                self._configs[overrides] = cfg
        return copy.deepcopy(cfg)  # a pipeline may adjust its config; the cached one stays as composed

    def strategies(self) -> list[str]:
        return available_strategies()

    def build(self, strategy: str, knobs: Knobs, extra: list[str]) -> Pipeline:
        """A pipeline on the shared model; UserError for an unknown strategy or a bad value."""
        if strategy not in self.strategies():
            raise UserError(f"unknown strategy {strategy!r}")
        cfg = self._compose((f"strategy={strategy}", *self.base_overrides, *knobs.overrides(), *extra))
        return Pipeline(cfg, run_plugins=self.run_plugins, engine=self.engine)

    def warm_up(self) -> float:
        """One short decode so the first visitor's timings are not paying for lazy initialisation."""
        t0 = time.perf_counter()
        self.build("baseline", Knobs(2, 0.0, None), [])("hi")
        return time.perf_counter() - t0

    def run_sides(self, pipes: list[Pipeline], prompt: str, sides: list[SideView], t_request: float,
                  cancel: threading.Event, min_interval: float = 0.1) -> Iterator[int]:
        """Decode every pipe's request at once (one engine batch), yielding the index of the side that changed
        as tokens arrive (each side at most every ``min_interval`` s). ``cancel`` (the visitor left) cancels
        whatever is still decoding."""
        updates: queue.Queue = queue.Queue()
        handles = []
        detoks = [IncrementalDetokenizer(p.tokenizer) for p in pipes]

        def on_step_for(i, tokenizer):
            def on_step(record, emitted):
                tokens = step_tokens(record, list(emitted), detoks[i])
                view = step_view(record, tokenizer) if record is not None else None
                updates.put((i, "step", (tokens, view, time.perf_counter())))
            return on_step

        def waiter(i, handle):
            try:
                updates.put((i, "done", handle.result()))
            except UserError as exc:
                updates.put((i, "error", str(exc)))
            except Exception as exc:  # a failing strategy must not take the page down: show it in its pane
                updates.put((i, "error", f"{type(exc).__name__}: {exc}"))

        try:
            for i, pipe in enumerate(pipes):
                try:
                    handles.append(pipe.submit(prompt, on_step=on_step_for(i, pipe.tokenizer)))
                except UserError as exc:
                    handles.append(None)
                    updates.put((i, "error", str(exc)))
            for i, handle in enumerate(handles):
                if handle is not None:
                    threading.Thread(target=waiter, args=(i, handle), name=f"wait-{sides[i].strategy}",
                                     daemon=True).start()
            last_yield = [0.0] * len(sides)
            dirty = [False] * len(sides)
            open_sides = len(sides)
            while open_sides:
                if cancel.is_set():
                    return
                try:
                    i, kind, payload = updates.get(timeout=min_interval)
                except queue.Empty:
                    i, kind, payload = None, None, None
                if kind == "done":
                    side = sides[i]
                    finish_tokens(side.tokens, detoks[i])
                    side.stats, side.text, side.run_id, side.done = payload.stats, payload.text, payload.run_id, True
                    open_sides -= 1
                    yield i
                    continue
                if kind == "error":
                    sides[i].error, sides[i].done = ("cancelled" if handles[i] is not None and
                                                     handles[i].status == "interrupted" else payload), True
                    open_sides -= 1
                    yield i
                    continue
                if kind == "step":
                    tokens, view, t_arrived = payload
                    side = sides[i]
                    if side.first_token_seconds is None and tokens:
                        side.first_token_seconds = t_arrived - t_request
                    side.tokens.extend(tokens)
                    if view is not None:
                        side.steps.append(view)
                    dirty[i] = True
                now = time.perf_counter()
                for j in range(len(sides)):
                    if dirty[j] and now - last_yield[j] >= min_interval:
                        last_yield[j], dirty[j] = now, False
                        yield j
        finally:
            for handle in handles:
                if handle is not None and not handle.done:
                    handle.cancel()
