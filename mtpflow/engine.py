"""The engine: one model, many requests in flight, decoded together.

    engine = Engine.from_overrides(["max_batch_size=8"])     # loads the model once
    results = engine.generate([Request(prompt="Hi"), Request(prompt="Summarize: ...", strategy="mtp")])
    for piece in engine.stream(Request(prompt="Tell me a joke")): print(piece, end="")
    handle = engine.submit(Request(prompt="...")); handle.cancel()

A FIFO queue feeds a running batch of at most ``max_batch_size`` sequences. Admission is bounded
(``engine.max_waiting`` requests waiting, optionally ``engine.max_wait_seconds`` in the queue): past a bound a
request is refused (``QueueFull``) rather than queued forever; a request's deadline (its ``timeout``, else
``engine.request_timeout``) ends it where it stands and frees its slot (``DeadlineExceeded``). Each step, every running
sequence drafts with its own stages, ONE target forward verifies all drafts (``mtpflow.loop.decode_step``),
and each commits its own tokens. Requests join and leave between steps; the requests admitted together are
prefilled together (packed rows), and while others decode at most ``prefill_tokens_per_step`` prompt tokens join
per step, so joining requests stall the running ones for a bounded time. One backend (``mtpflow.backends``,
``model.backend``) runs every target forward; the engine owns the KV pool it runs them over. One background
thread owns the model, the KV pool and every stage call; ``submit`` is safe from any thread, and handles can be
awaited from asyncio.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import logging
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from mtpflow.config import available_strategies, check_batch_k, compose, to_container, validate
from mtpflow.errors import (ConfigError, DeadlineExceeded, EngineClosed, QueueFull, QueueTimeout, UserError, check_int,
                            check_seconds, debug_enabled, describe, internal_cause, traceback_text)
from mtpflow.backends import ExecutionSpec, create as create_backend
from mtpflow.kernels.dispatch import use_impl
from mtpflow.loop import Sequence, StepCallback, decode_step
from mtpflow.model import load_configured
from mtpflow.plugins.manager import build_stages, default_run_plugins, make_plugin_manager
from mtpflow.prefix_cache import PrefixKVCache
from mtpflow.request import Prepared, Request, apply_overrides, resolve_request
from mtpflow.shared import SharedState
from mtpflow.strategy_choice import resolve_choice
from mtpflow.target import prefill_many
from mtpflow.types import DecodeResult

log = logging.getLogger("mtpflow")  # a request's internal error: its traceback, at ERROR

IDLE_EXIT_SECONDS = 10.0
WAITING, RUNNING, COMPLETE, FAILED, INTERRUPTED = "waiting", "running", "complete", "failed", "interrupted"


@dataclass(frozen=True)
class Admission:
    """The engine's admission bounds (config ``engine.*``): ``max_waiting`` requests may wait beyond a full
    batch; a request may wait ``max_wait_seconds`` in the queue (None: no bound); a request without its own
    ``timeout`` gets ``request_timeout`` seconds from submit to its end (None: no deadline)."""

    max_waiting: int = 64
    max_wait_seconds: float | None = None
    request_timeout: float | None = None

    @classmethod
    def from_config(cls, cfg) -> Admission:
        """Read ``engine.max_waiting``, ``engine.max_wait_seconds`` and ``engine.request_timeout``. The old
        top-level ``max_waiting`` still works: when set (not null) it is the bound; set to another value than
        ``engine.max_waiting`` as well, it is a ConfigError (which one was meant is unknowable)."""
        node = cfg.get("engine") or {}
        waiting = node.get("max_waiting", cls.max_waiting)
        legacy = cfg.get("max_waiting")
        if legacy is not None:
            if node.get("max_waiting") not in (None, cls.max_waiting, legacy):
                raise ConfigError(f"max_waiting ({legacy!r}) and engine.max_waiting ({node.get('max_waiting')!r}) "
                                  "disagree: set engine.max_waiting only (max_waiting is its old spelling)")
            waiting = legacy
        return cls(max_waiting=check_int("engine.max_waiting", waiting, 0),
                   max_wait_seconds=_seconds("engine.max_wait_seconds", node.get("max_wait_seconds")),
                   request_timeout=_seconds("engine.request_timeout", node.get("request_timeout")))


def _seconds(name: str, value) -> float | None:
    """A positive, finite number of seconds, or None (no bound)."""
    return None if value is None else check_seconds(name, value)


class RequestHandle:
    """A submitted request: its tokens as they commit, its result, its cancellation."""

    def __init__(self, engine: Engine, prepared: Prepared, on_step: StepCallback | None, plugin_manager):
        self.engine = engine
        self.prepared = prepared
        self.id = next(engine._ids)
        self.prompt_tokens = int(prepared.prompt_ids.numel())
        self.status = WAITING
        self.submitted_at = time.perf_counter()
        self.finished_at: float | None = None
        admission = engine.admission
        timeout = prepared.timeout if prepared.timeout is not None else admission.request_timeout
        self.timeout = timeout
        # perf_counter times past which the engine ends the request (None: no bound)
        self.deadline = None if timeout is None else self.submitted_at + timeout
        wait = admission.max_wait_seconds
        self.wait_deadline = None if wait is None else self.submitted_at + wait
        self._user_on_step = on_step
        self._plugin_manager = plugin_manager  # this request's own stage objects and run plugins
        self._tokens: list[int] = []
        self._cond = threading.Condition()
        # threads in stream() waiting for tokens: a step wakes the condition's waiters only when there are some, so
        # a thread in result() (which only the end concerns) is not woken, and does not take the GIL and a core
        # from the step, every step
        self._token_waiters = 0
        self._cancelled = False
        self._result: DecodeResult | None = None
        self._error: BaseException | None = None
        self._async_events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # ----- called from the engine thread ---------------------------------------------------------------------
    def _on_step(self, record, tokens) -> None:
        with self._cond:
            self._tokens.extend(tokens)
            if self._token_waiters:
                self._cond.notify_all()
        self._wake_async()
        if self._user_on_step is not None:
            self._user_on_step(record, tokens)

    def _finish(self, status: str, result: DecodeResult | None, error: BaseException | None = None) -> None:
        self.finished_at = time.perf_counter()
        with self._cond:
            self.status, self._result, self._error = status, result, error
            self._cond.notify_all()
        self._wake_async()

    def _wake_async(self) -> None:
        for loop, event in list(self._async_events):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop has closed
                pass

    # ----- for the caller ----------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.status in (COMPLETE, FAILED, INTERRUPTED)

    def cancel(self, wait: bool = False, timeout: float = 60.0) -> None:
        """Stop this request: it leaves the batch before the next step; its run is recorded interrupted.
        ``wait`` blocks until it has left (its trace written)."""
        self._cancelled = True
        self.engine._wake()
        if wait and threading.current_thread() is not self.engine._thread:
            with self._cond:
                self._cond.wait_for(lambda: self.done, timeout)

    def result(self, timeout: float | None = None) -> DecodeResult:
        """Wait for the end; a failed request raises its error (a UserError for the caller's mistakes)."""
        self._waiting()
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id} is still {self.status}")
        if self._error is not None:
            raise self._error
        return self._result

    def _text(self, tokens: list[int], final: bool) -> str:
        """The visible text of ``tokens``: cut at a stop string; while running, hold back an incomplete UTF-8
        character or a tail that may be the start of a stop string."""
        text = self.engine.loaded.tokenizer.decode(tokens, skip_special_tokens=True)
        stops = self.prepared.stop
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
        if final:
            return text
        if text.endswith("\ufffd"):
            text = text[:-1]
        hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return text[: len(text) - hold] if hold else text

    def stream(self) -> Iterator[str]:
        """Text pieces as tokens commit. Leaving the loop early (break, an exception) cancels the request."""
        cursor, finished = _PieceCursor(self), False
        self._waiting()
        try:
            while not finished:
                with self._cond:
                    self._token_waiters += 1
                    try:
                        self._cond.wait_for(cursor.ready)
                    finally:
                        self._token_waiters -= 1
                piece, finished = cursor.take()
                if piece:
                    yield piece
        finally:
            if not finished:
                self.cancel()

    async def aresult(self) -> DecodeResult:
        """``result()`` for asyncio code."""
        event = self._attach()
        try:
            while not self.done:
                await event.wait()
                event.clear()
        finally:
            self._detach(event)
        return self.result()

    async def astarted(self) -> None:
        """Wait (asyncio) until the first token has committed or the request has ended: refused from the queue,
        failed, cancelled. The server answers with a status line only then, so a refusal is a real 429."""
        event = self._attach()
        try:
            while not (self._tokens or self.done):
                await event.wait()
                event.clear()
        finally:
            self._detach(event)

    async def astream(self):
        """``stream()`` for asyncio code: an async iterator of text pieces; closing it early cancels."""
        event = self._attach()
        cursor, finished = _PieceCursor(self), False
        try:
            while not finished:
                with self._cond:
                    ready = cursor.ready()
                if not ready:
                    await event.wait()
                    event.clear()
                    continue
                piece, finished = cursor.take()
                if piece:
                    yield piece
        finally:
            self._detach(event)
            if not finished:
                self.cancel()

    def _waiting(self) -> None:
        """The calling thread is about to wait for the engine: what it holds (idle OpenMP workers) would slow the
        engine's thread down (``Backend.thread_idle``)."""
        self.engine.backend.thread_idle()

    def _attach(self) -> asyncio.Event:
        self._waiting()
        event = asyncio.Event()
        self._async_events.append((asyncio.get_running_loop(), event))
        if self.done or self._tokens:
            event.set()
        return event

    def _detach(self, event) -> None:
        self._async_events = [(lp, ev) for lp, ev in self._async_events if ev is not event]


class _PieceCursor:
    """How far a reader of a handle's text has got: ``stream`` and ``astream`` differ only in how they wait for
    ``ready``, and share what a step's tokens become (``take``)."""

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.seen = 0  # tokens already turned into text
        self.printed = 0  # characters of that text already handed out

    def ready(self) -> bool:
        """New tokens or the end (call under the handle's condition)."""
        return len(self.handle._tokens) > self.seen or self.handle.done

    def take(self) -> tuple[str, bool]:
        """(the text not handed out yet, whether the request has ended); a failed request raises its error."""
        handle = self.handle
        with handle._cond:
            tokens, done = list(handle._tokens), handle.done
        if done and handle._error is not None:
            raise handle._error
        self.seen = len(tokens)
        text = handle._text(tokens, final=done)
        piece = text[self.printed:]
        self.printed = max(self.printed, len(text))
        return piece, done


class Engine:
    """Owns the model, the KV pool, the queue and the running batch; decodes in one background thread."""

    def __init__(self, cfg: DictConfig, run_plugins: tuple = (), loaded=None):
        validate(cfg)
        self.cfg = cfg
        self.max_batch_size = check_int("max_batch_size", cfg.get("max_batch_size", 8), 1, 256)
        self.admission = Admission.from_config(cfg)
        self.prefill_tokens_per_step = check_int("prefill_tokens_per_step", cfg.get("prefill_tokens_per_step", 512), 1)
        # prompt prefixes' KV reused across requests (mtpflow.prefix_cache), in RunContext.shared; 0 turns it off
        self.prefix_cache_bytes = check_int("prefix_cache_mb", cfg.get("prefix_cache_mb", 256), 0) * 2**20
        m = cfg.model
        self.default_strategy = str(cfg.strategy.get("name"))
        self._strategies: dict[str, DictConfig] = {self.default_strategy: cfg.strategy}
        build_stages(cfg.strategy)  # the default strategy's parameters are checked before the (slow) model load
        # how the target computes, decided once from the config (mtpflow.backends.execution)
        self.execution = ExecutionSpec.from_config(cfg)
        # ``loaded`` lets tests, the playground and pipelines share a model that is already in memory
        self.loaded = loaded or load_configured(m, self.execution)
        # the one backend that runs every target forward of this engine (mtpflow.backends)
        self.backend = create_backend(self.loaded.model, self.execution, int8=self.loaded.int8)
        self.run_plugins = list(run_plugins)
        self.shared = SharedState()  # state shared on purpose across requests (a suffix cache, calibration)
        self.pool = self.backend.make_pool(self.max_batch_size)
        self._base_config = to_container(cfg)
        self._notices: set[str] = set()  # what resolve_strategy has said (each line once per engine)
        self._strategies[self.default_strategy] = self.resolve_strategy(cfg.strategy)
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._running: list[tuple[Sequence, RequestHandle]] = []
        self._lock = threading.Condition()
        self._closing = False
        self._drain = True
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self._step_listeners: list[Callable[[int, int], None]] = []
        self._strategy_lock = threading.Lock()
        self.steps = 0
        self.batch_k = check_batch_k(cfg.get("batch_k", "auto"))
        self._batch_costs = None  # BatchCostModel, measured (or read from the cache) at the first batched step
        atexit.register(_stop_at_exit, weakref.ref(self))  # end the decode thread before the interpreter does

    @classmethod
    def from_overrides(cls, overrides: list[str] | tuple[str, ...] = (), **kwargs) -> Engine:
        """An engine for ``compose(overrides)`` (e.g. ``["model.name=...", "max_batch_size=16"]``), with the
        config's run plugins (traces) unless ``run_plugins`` is given."""
        cfg = compose(list(overrides))
        if "run_plugins" not in kwargs:
            kwargs["run_plugins"] = default_run_plugins(cfg)
        return cls(cfg, **kwargs)

    # ----- requests ----------------------------------------------------------------------------------------------
    def strategies(self) -> list[str]:
        return available_strategies()

    def strategy_config(self, name: str | None) -> DictConfig:
        """The strategy's config node, composed once per engine (Hydra is never composed per request)."""
        name = name or self.default_strategy
        with self._strategy_lock:
            if name not in self._strategies:
                if not isinstance(name, str) or name not in available_strategies():
                    raise UserError(f"unknown strategy {name!r}; available: {', '.join(available_strategies())}")
                self._strategies[name] = self.resolve_strategy(compose([f"strategy={name}"]).strategy)
            return self._strategies[name]

    def resolve_strategy(self, strategy: DictConfig) -> DictConfig:
        """``strategy`` as it runs on this engine: one chosen by measurement (``mtp``) becomes the candidate the
        tuning profile names for this model, backend and precision, else its default with one notice line on
        standard error (``mtpflow.strategy_choice``); any other comes back as it is."""
        node, notice = resolve_choice(strategy, self.loaded, self.backend, self._base_config.get("model") or {},
                                      build_stages, self.cfg.get("profile"))
        if notice is not None and notice not in self._notices:
            self._notices.add(notice)
            print(notice, file=sys.stderr, flush=True)
        return node

    def prepare(self, request: Request, strategy_config: DictConfig | None = None) -> tuple[Prepared, Any]:
        """Check a request (one UserError line for any mistake) and build its stages' plugin manager."""
        if not isinstance(request, Request):
            raise UserError(f"expected a Request, got {type(request).__name__}")
        strategy = strategy_config if strategy_config is not None else self.strategy_config(request.strategy)
        if request.overrides:
            strategy = apply_overrides(strategy, request.overrides)
        prepared, settings = resolve_request(request, self.cfg, strategy, self.loaded)
        config = dict(self._base_config)
        config.update(settings)
        config["strategy"] = OmegaConf.to_container(strategy, resolve=True)
        object.__setattr__(prepared.context, "config", config)
        object.__setattr__(prepared.context, "shared", self.shared)
        object.__setattr__(prepared.context, "backend", self.backend)
        return prepared, config

    def check(self, request: Request) -> int:
        """Check a request without running it; returns its prompt length in tokens."""
        prepared, _ = self.prepare(request)
        make_plugin_manager(prepared.strategy)  # builds (and so checks) every stage
        return int(prepared.prompt_ids.numel())

    def submit(self, request: Request, *, on_step: StepCallback | None = None, extra_plugins: tuple = (),
               strategy_config: DictConfig | None = None, keep_steps: bool = False,
               wait: bool = False) -> RequestHandle:
        """Queue a request; returns at once. Raises UserError for a bad request, QueueFull when the waiting
        queue is at ``engine.max_waiting``, EngineClosed after ``shutdown``. ``keep_steps`` keeps every step's
        record in the result (the playground and tests read them); ``on_step(record, tokens)`` is called in the
        engine thread after each step. ``wait`` blocks while the queue is full instead of raising QueueFull.
        A full queue is checked first too, before the request is tokenized: under overload a refusal costs
        next to nothing and comes at once."""
        if not wait:
            with self._lock:
                if self._full():
                    raise self._queue_full()
        prepared, _ = self.prepare(request, strategy_config)
        if self._closing:
            raise EngineClosed("the engine is shutting down and takes no new requests")
        plugins = tuple(f(self) for f in self.run_plugins) + tuple(extra_plugins)
        # the request's own stage objects, built (and so checked) now, in the caller's thread
        plugin_manager = make_plugin_manager(prepared.strategy, plugins)
        handle = RequestHandle(self, prepared, on_step, plugin_manager)
        handle._keep_steps = keep_steps
        with self._lock:
            if self._closing:
                raise EngineClosed("the engine is shutting down and takes no new requests")
            if wait:
                self._lock.wait_for(lambda: not self._full() or self._closing)
                if self._closing:
                    raise EngineClosed("the engine is shutting down and takes no new requests")
            if self._full():
                raise self._queue_full()
            self._queue.append(handle)
            self._start_thread()
            self._lock.notify_all()
        return handle

    def _full(self) -> bool:
        """No room: a full batch and ``max_waiting`` more (called with the lock held)."""
        return len(self._queue) + len(self._running) >= self.max_batch_size + self.max_waiting

    def _queue_full(self) -> QueueFull:
        return QueueFull(f"the server is at capacity: {len(self._running)} requests running and "
                         f"{len(self._queue)} waiting (engine.max_waiting is {self.max_waiting}); try again shortly")

    def submit_many(self, requests: list[Request], **kwargs) -> list[RequestHandle]:
        """Queue several requests at once (``submit(..., wait=True)`` each, with the same keywords): the queue
        lock is held while they are queued (waiting for room releases it), so an idle engine admits them
        together instead of starting on the first while the rest are still being checked."""
        with self._lock:
            return [self.submit(r, wait=True, **kwargs) for r in requests]

    def generate(self, requests: list[Request] | Request) -> list[DecodeResult]:
        """Decode a list of requests together (``submit_many``); results in the same order (a failed one
        raises)."""
        single = isinstance(requests, Request)
        handles = self.submit_many([requests] if single else requests)
        results = [h.result() for h in handles]
        return results[0] if single else results

    def stream(self, request: Request) -> Iterator[str]:
        """Text pieces of one request as its tokens commit."""
        return self.submit(request).stream()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def max_waiting(self) -> int:
        """``engine.max_waiting`` (``admission``), kept readable under its old name."""
        return self.admission.max_waiting

    def healthy(self) -> bool:
        """False when the decoding thread ended without saying so (it clears itself when it goes idle or shuts
        down) or when requests wait with no thread to run them: a health check (Ray Serve's) restarts the
        replica then."""
        with self._lock:  # submit starts the thread while holding it
            thread, busy = self._thread, bool(self._queue or self._running)
        return thread.is_alive() if thread is not None else not busy

    def add_step_listener(self, listener: Callable[[int, int], None]) -> None:
        """``listener(batch_size, new_tokens)`` after every batched step (metrics)."""
        self._step_listeners.append(listener)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new requests; finish the running and waiting ones (``drain``) or cancel them."""
        with self._lock:
            self._closing, self._drain = True, drain
            if not drain:
                for handle in self._queue:
                    handle._cancelled = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def close(self) -> None:
        self.shutdown(drain=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- the engine thread ----------------------------------------------------------------------------------------
    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name="mtpflow-engine", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        with use_impl(self.execution.kernels), self.backend.running(), torch.inference_mode():
            while True:
                with self._lock:
                    if not (self._queue or self._running or self._closing):
                        self.backend.thread_idle()  # idle: let a caller's own torch work run at full speed
                    if not self._lock.wait_for(lambda: self._queue or self._running or self._closing,
                                               IDLE_EXIT_SECONDS):
                        self._thread = None  # idle: the thread ends (an unused engine can be collected);
                        return  # the next submit starts a new one

                    if self._closing and not self._running and (not self._queue or not self._drain):
                        for handle in list(self._queue):
                            self._queue.remove(handle)
                            handle._finish(INTERRUPTED, None, EngineClosed("the engine shut down before this request ran"))
                        self._thread = None
                        return
                try:
                    self._expire()
                    self._admit()
                    self._step()
                except BaseException as exc:  # noqa: BLE001 - an engine bug fails the batch, never the thread
                    for seq, handle in list(self._running):
                        self._end(seq, handle, exc)

    def _expire(self) -> None:
        """Refuse the waiting requests past ``engine.max_wait_seconds`` (QueueTimeout) and end those past their
        deadline (DeadlineExceeded), running or waiting; each running one leaves the batch (its slot freed,
        its run recorded failed) before the next step."""
        now = time.perf_counter()
        with self._lock:
            waiting = [h for h in self._queue if _past(h.wait_deadline, now) or _past(h.deadline, now)]
            for handle in waiting:
                self._queue.remove(handle)
            if waiting:
                self._lock.notify_all()  # a submit waiting for room
        for handle in waiting:
            waited = now - handle.submitted_at
            if _past(handle.deadline, now):
                handle._finish(FAILED, None, _deadline_error(handle, now))
            else:
                handle._finish(FAILED, None, QueueTimeout(
                    f"the request waited {waited:.1f} s for a free slot, over engine.max_wait_seconds "
                    f"({self.admission.max_wait_seconds:g} s); try again shortly"))
        for seq, handle in list(self._running):
            if _past(handle.deadline, now):
                self._end(seq, handle, _deadline_error(handle, now, len(handle._tokens)))

    def _admit(self) -> None:
        """Start waiting requests while there is room: all of them into an idle engine; while others decode,
        as many as fit in ``prefill_tokens_per_step`` prompt tokens (always at least one), so joining
        requests stall the running ones for a bounded time. The ones admitted together are prefilled together
        (``_start``)."""
        budget = self.max_batch_size - len(self._running)
        tokens_left = self.prefill_tokens_per_step if self._running else None
        admitted: list[RequestHandle] = []
        while budget > 0:
            with self._lock:
                if not self._queue:
                    break
                handle = self._queue[0]
                size = int(handle.prepared.prompt_ids.numel())
                if tokens_left is not None and admitted and size > tokens_left:
                    break
                self._queue.popleft()
            if handle._cancelled:
                handle._finish(INTERRUPTED, None, None)
                continue
            budget -= 1
            admitted.append(handle)
            if tokens_left is not None:
                tokens_left -= size
        if admitted:
            self._start(admitted)

    def _start(self, handles: list[RequestHandle]) -> None:
        """Begin each request (its run-start hooks, a KV slot), prefill them in as few forwards as the model allows
        (``target.prefill_many``: packed rows), then give each its first token. A request whose hooks fail ends
        alone; if the shared prefill fails, each prompt is prefilled again alone, so only a request whose own
        prefill fails ends with it."""
        prefix_cache = self.shared.get("prefix_kv", lambda: PrefixKVCache(self.prefix_cache_bytes)) \
            if self.prefix_cache_bytes else None
        begun: list[tuple[Sequence, RequestHandle, torch.Tensor]] = []
        for handle in handles:
            p = handle.prepared
            seq = None
            try:
                seq = Sequence(handle._plugin_manager, self.loaded, self.backend, p.context, stop=p.stop,
                               need_hidden=p.need_hidden,
                               context_window=p.context_window, pool=self.pool, on_step=handle._on_step,
                               keep_steps=handle._keep_steps, prefix_cache=prefix_cache)
                handle.status = RUNNING
                self._running.append((seq, handle))
                begun.append((seq, handle, seq.begin()))
            except BaseException as exc:  # noqa: BLE001 - the request fails alone
                self._end(seq, handle, exc)
        if not begun:
            return
        try:
            prefills = prefill_many([s.target for s, _, _ in begun], [p for _, _, p in begun], prefix_cache)
        except BaseException:  # noqa: BLE001 - retried one by one below: a bad prompt fails alone
            prefills = [None] * len(begun)
            for seq, _, _ in begun:
                seq.target.cache_len = 0
        for (seq, handle, prompt), done in zip(begun, prefills):
            try:
                if done is None:
                    done = (*seq.target.prefill(prompt), 0) if prefix_cache is None else \
                        seq.target.prefill_cached(prompt, prefix_cache)
                seq.started(*done)
            except BaseException as exc:  # noqa: BLE001 - the request fails alone
                self._end(seq, handle, exc)
                continue
            if seq.done:
                self._end(seq, handle, None)

    def _step(self) -> None:
        for seq, handle in list(self._running):
            if handle._cancelled:
                self._end(seq, handle, KeyboardInterrupt())
        if not self._running:
            return
        errors: dict[int, BaseException] = {}
        sequences = [s for s, _ in self._running]
        before = sum(s.stats.new_tokens for s in sequences)
        try:
            decode_step(sequences, self.backend, rows_cap=self._rows_cap if self.batch_k == "auto" else None,
                        on_error=lambda s, e: errors.__setitem__(id(s), e))
        except BaseException as exc:  # noqa: BLE001 - the shared forward failed: every sequence in it fails
            errors.update({id(s): exc for s in sequences if id(s) not in errors})
        self.steps += 1
        new_tokens = sum(s.stats.new_tokens for s in sequences) - before
        for listener in self._step_listeners:
            try:
                listener(len(sequences), new_tokens)
            except Exception:  # a metrics hook never stops decoding
                pass
        for seq, handle in list(self._running):
            if id(seq) in errors:
                self._end(seq, handle, errors[id(seq)])
            elif seq.done:
                self._end(seq, handle, None)

    def _rows_cap(self, sequences: list[Sequence], sizes: list[int]) -> int:
        """Batch-aware K: the rows per sequence that maximise the batch's expected tokens per second under the
        measured cost of one batched forward (``mtpflow.cost_model.BatchCostModel``)."""
        if self._batch_costs is None:
            from mtpflow.cost_model import load_batch_costs

            self._batch_costs, _ = load_batch_costs(self.loaded, self.backend, profile=self.cfg.get("profile"))
        return self._batch_costs.best_rows([s.acceptance.value for s in sequences], sizes)

    def _end(self, seq: Sequence | None, handle: RequestHandle, error: BaseException | None) -> None:
        """End a request: its run-end hooks, then its handle's status, result and error. An internal error (not a
        ``UserError``) becomes one line naming the stage and the exception (``decoding failed in stage propose
        (Class, strategy pld): ZeroDivisionError: ...``); its traceback goes to the ``mtpflow`` logger at ERROR
        and, through the stage timer, into the result's stats for ``on_run_end`` (the trace recorder stores it
        with the run). A third-party plugin's ``PluginError`` is already the user's one line: its cause is logged
        at DEBUG. ``MTPFLOW_DEBUG=1`` hands the caller the original exception instead."""
        def report(error: BaseException) -> str:
            cause = internal_cause(error)
            stage, plugin = (seq.timer.stage_of(error) or (seq.stage, None)) if seq is not None else ("start", None)
            strategy = handle.prepared.context.strategy
            where = f"{plugin}, strategy {strategy}" if plugin else f"strategy {strategy}"
            if isinstance(error, UserError):  # a PluginError: it names the plugin and the hook itself
                line = str(error)
                log.debug("request %s: %s (stage %s)", handle.id, line, stage, exc_info=cause)
            else:
                line = f"decoding failed in stage {stage} ({where}): {describe(error)}"
                log.error("request %s: %s", handle.id, line, exc_info=cause)
            if seq is not None:
                seq.timer.report = {"error": line, "error_traceback": traceback_text(cause)}
            return line

        with self._lock:
            self._running = [(s, h) for s, h in self._running if h is not handle]
            self._lock.notify_all()  # a submit waiting for room
        interrupted = isinstance(error, KeyboardInterrupt)
        status = INTERRUPTED if interrupted else FAILED if error is not None else COMPLETE
        line = report(error) if status == FAILED and internal_cause(error) is not None else None
        result = None
        try:
            result = seq.end(status) if seq is not None else None
        except BaseException as exc:  # noqa: BLE001 - on_run_end of a broken plugin
            if error is None:
                error, status = exc, FAILED
                line = report(exc) if internal_cause(exc) is not None else None
        if result is not None:
            result.stats.pop("error_traceback", None)  # in the run's trace; the one line stays in its stats
        cause = internal_cause(error) if status == FAILED else None
        if cause is not None and debug_enabled():
            error = cause  # MTPFLOW_DEBUG=1: the caller gets the original exception, traceback and all
        elif status == FAILED and not isinstance(error, UserError):
            error = _as_user_error(error, line)
        handle._finish(status, result, None if interrupted else error)


def _past(deadline: float | None, now: float) -> bool:
    return deadline is not None and now >= deadline


def _deadline_error(handle: RequestHandle, now: float, tokens: int | None = None) -> DeadlineExceeded:
    where = "in the queue" if tokens is None else f"after {tokens} tokens"
    return DeadlineExceeded(f"the request ran past its deadline of {handle.timeout:g} s (timeout) and was stopped "
                            f"{where}, {now - handle.submitted_at:.1f} s after it arrived")


def _stop_at_exit(ref) -> None:
    engine = ref()
    if engine is not None and engine._thread is not None:
        engine.shutdown(drain=False, timeout=5.0)


def _as_user_error(error: BaseException, line: str | None = None) -> UserError:
    """A stage that raised mid-decode fails its request with one line naming the stage and the error (``line``,
    built by ``Engine._end``); the original stays reachable as ``__cause__``."""
    wrapped = UserError(line or f"decoding failed: {describe(error)}")
    wrapped.__cause__ = error
    return wrapped
