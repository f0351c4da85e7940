"""A stand-in with the interface of ``mtpflow.engine.Engine`` for fast tests of the HTTP layer: a thread
"decodes" every running sequence one step at a time (a few characters of ``echo: <prompt>`` per step), with a
bounded batch and a bounded waiting queue, cancellation, stop strings and step listeners.

Requests are the real ``mtpflow.engine.Request`` (and errors the real ``QueueFull``).
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from mtpflow.errors import EngineClosed, QueueFull, UserError
from mtpflow.request import Request

DONE = object()


@dataclass
class FakeResult:
    text: str
    token_ids: list[int]
    stats: dict
    run_id: int | None = None


class FakeHandle:
    def __init__(self, engine: "FakeEngine", req: Request, prompt_text: str):
        self.engine, self.req = engine, req
        self.prompt_tokens = len(prompt_text)
        self.status = "waiting"
        self.target = f"echo: {prompt_text}"
        self.emitted = 0
        self._pieces: list[str] = []
        self._listeners: list = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._result: FakeResult | None = None
        self._error: BaseException | None = None
        self.cancelled = False

    # engine side
    def _push(self, item) -> None:
        with self._lock:
            if item is not DONE:
                self._pieces.append(item)
            listeners = list(self._listeners)
        for loop, q in listeners:
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _finish(self, status: str, stop_reason: str | None = None, error: BaseException | None = None) -> None:
        text = "".join(self._pieces)
        self.status = status
        self._error = error
        if error is None and status == "complete":
            self._result = FakeResult(text, [ord(c) for c in text],
                                      {"new_tokens": len(text), "mal": 2.0, "accepted_tokens": len(text) // 2,
                                       "stop_reason": stop_reason, "trace_run_id": None})
        self.engine.finished.append(self)
        self._done.set()
        self._push(DONE)

    # client side
    def stream(self):
        i = 0
        while True:
            with self._lock:
                pieces = self._pieces[i:]
            for p in pieces:
                yield p
            i += len(pieces)
            if self._done.is_set() and i == len(self._pieces):
                break
            time.sleep(0.002)
        if self._error:
            raise self._error

    async def astream(self):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            for p in self._pieces:
                q.put_nowait(p)
            if self._done.is_set():
                q.put_nowait(DONE)
            self._listeners.append((loop, q))
        while (item := await q.get()) is not DONE:
            yield item
        if self._error:
            raise self._error

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def astarted(self):
        while not (self._pieces or self._done.is_set()):
            await asyncio.sleep(0.002)

    def result(self, timeout=None):
        if not self._done.wait(timeout):
            raise TimeoutError
        if self._error:
            raise self._error
        return self._result

    async def aresult(self):
        while not self._done.is_set():
            await asyncio.sleep(0.005)
        return self.result()

    def cancel(self) -> None:
        self.cancelled = True
        self.engine._cancel(self)


class FakeEngine:
    """``step_seconds`` per step; each step a running sequence commits ``chars_per_step`` characters."""

    def __init__(self, max_batch_size: int = 4, max_waiting: int = 8, step_seconds: float = 0.01,
                 chars_per_step: int = 2, context: int = 200, fail_on: str = "FAIL"):
        self.max_batch_size, self.max_waiting = max_batch_size, max_waiting
        self.step_seconds, self.chars_per_step, self.context = step_seconds, chars_per_step, context
        self.fail_on = fail_on  # a prompt containing this fails inside the "decode" (an internal error)
        self.running: list[FakeHandle] = []
        self.waiting: list[FakeHandle] = []
        self.finished: list[FakeHandle] = []
        self.listeners = []
        self.lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def strategies(self) -> list[str]:
        return ["baseline", "pld"]

    def check(self, req: Request) -> int:
        given = [x is not None for x in (req.prompt, req.messages, req.prompt_ids)]
        if sum(given) != 1:
            raise UserError("give exactly one of prompt, messages, prompt_ids")
        if req.strategy is not None and req.strategy not in self.strategies():
            raise UserError(f"unknown strategy {req.strategy!r}")
        for k in req.overrides:
            if k not in ("k", "propose.max_ngram"):
                raise UserError(f"unknown override {k!r} for this strategy")
        text = self._text(req)
        if not text.strip():
            raise UserError("empty prompt")
        if len(text) > self.context:
            raise UserError(f"the prompt is {len(text)} tokens; the model's context is {self.context}")
        return len(text)

    @staticmethod
    def _text(req: Request) -> str:
        if req.messages is not None:
            return " | ".join(m["content"] for m in req.messages)
        if req.prompt_ids is not None:
            return "".join(chr(65 + i % 26) for i in req.prompt_ids)
        return req.prompt

    def submit(self, req: Request) -> FakeHandle:
        self.check(req)
        with self.lock:
            if self.closed:
                raise EngineClosed("the engine is shutting down and takes no new requests")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
            h = FakeHandle(self, req, self._text(req))
            self.waiting.append(h)
            return h

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add_step_listener(self, fn) -> None:
        self.listeners.append(fn)

    def _cancel(self, h: FakeHandle) -> None:
        with self.lock:
            if h in self.waiting:
                self.waiting.remove(h)
            elif h in self.running:
                self.running.remove(h)
            else:
                return
        h._finish("interrupted")

    def _loop(self) -> None:
        while True:
            with self.lock:
                if self.closed and not self.running and not self.waiting:
                    return
                while self.waiting and len(self.running) < self.max_batch_size:
                    h = self.waiting.pop(0)
                    h.status = "running"
                    self.running.append(h)
                batch = list(self.running)
            if not batch:
                time.sleep(0.002)
                continue
            time.sleep(self.step_seconds)
            new = 0
            for h in batch:
                if h.status != "running":
                    continue
                if self.fail_on and self.fail_on in h.target:
                    self._drop(h)
                    h._finish("failed", error=UserError("decoding failed: RuntimeError: boom inside the fake decode"))
                    continue
                limit = h.req.max_new_tokens or 64
                stops = h.req.stop or ()
                step = h.target[h.emitted:h.emitted + self.chars_per_step][: limit - h.emitted]
                h.emitted += len(step)
                new += len(step)
                full = h.target[:h.emitted]
                hits = [full.index(s) for s in stops if s in full]
                reason = ("stop_string" if hits else "max_new_tokens" if h.emitted >= limit
                          else "eos" if h.emitted >= len(h.target) else None)
                visible = full[:min(hits)] if hits else full
                if reason is None:  # hold back a tail that may be the start of a stop string
                    hold = max([n for s in stops for n in range(1, len(s)) if full.endswith(s[:n])] or [0])
                    visible = full[:len(full) - hold]
                piece = visible[len("".join(h._pieces)):]
                if piece:
                    h._push(piece)
                if reason:
                    self._drop(h)
                    h._finish("complete", reason)
            for fn in self.listeners:
                fn(len(batch), new)

    def _drop(self, h: FakeHandle) -> None:
        with self.lock:
            if h in self.running:
                self.running.remove(h)

    def shutdown(self, drain: bool = True) -> None:
        with self.lock:
            self.closed = True
            victims = [] if drain else self.running + self.waiting
        for h in victims:
            h.cancel()
        self.thread.join(timeout=30)
