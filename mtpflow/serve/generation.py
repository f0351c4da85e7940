"""One completion request on the engine: submit it, stream its text pieces (server-sent events) or wait for the
whole result, cancel it when the client goes away, and record its latencies and outcome in the metrics.

The status line waits for the request's first token (``Generation.started``): a request refused from the queue
(``engine.max_wait_seconds``), past its deadline or failed before its first token gets its own status (429, 408,
500), streamed or not. A client that disconnects cancels its sequence (the engine records the run
``interrupted``); the others in the batch go on. A failure after the stream started is sent as an ``error`` event
(the status line is gone).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

import anyio

from mtpflow.errors import DeadlineExceeded, EngineClosed, QueueFull, QueueTimeout, UserError
from mtpflow.serve.protocol import ApiError, Parsed, ResponseBuilder, error_body, finish_reason, mtpflow_field, usage

log = logging.getLogger("mtpflow.serve")


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


RETRY_AFTER_SECONDS = "1"  # Retry-After of a refusal (a full queue, a wait past engine.max_wait_seconds)


def outcome(exc: BaseException) -> str:
    """The ``outcome`` label of ``mtpflow_server_requests_total`` for a request that ended with ``exc``."""
    for kind, label in ((QueueTimeout, "queue_timeout"), (QueueFull, "queue_full"), (DeadlineExceeded, "timeout"),
                        (EngineClosed, "unavailable"), (Interrupted, "interrupted")):
        if isinstance(exc, kind):
            return label
    return "failed"


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def failure(exc: BaseException) -> ApiError:
    """A failed decode as an API error, one line, never a traceback: 429 for a refusal from the queue, 408 past
    the request's deadline (with ``x-should-retry: false``: the OpenAI client would otherwise send it again),
    503 when the engine shut down under it, 500 when a stage failed mid-decode (the engine reports it as
    "decoding failed: ..."), 400 for the rest of the caller's mistakes."""
    message = _line(exc)
    if isinstance(exc, QueueFull):  # the queue is at engine.max_waiting, or (QueueTimeout) a wait past its bound
        return ApiError(429, message, type="rate_limit_error", code=outcome(exc),  # queue_full, queue_timeout
                        headers={"Retry-After": RETRY_AFTER_SECONDS})
    if isinstance(exc, DeadlineExceeded):
        return ApiError(408, message, type="timeout_error", param="timeout", code="request_timeout",
                        headers={"x-should-retry": "false"})
    if isinstance(exc, EngineClosed):
        return ApiError(503, message, type="server_error", code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(exc, UserError) and not message.startswith("decoding failed"):
        return ApiError(400, message)
    log.error("decode failed: %s", message)  # the engine logged the traceback (logger "mtpflow") already
    return ApiError(500, f"the decode failed on the server: {message}", type="server_error")


class Interrupted(Exception):
    """The engine cancelled the request (shutdown without drain)."""


async def submit(engine, request, metrics, endpoint: str):
    """``engine.submit`` off the event loop (it tokenizes and builds the request's stages); errors become
    4xx/503 error objects."""
    from mtpflow.request import ContextLengthExceeded

    try:
        return await anyio.to_thread.run_sync(engine.submit, request)
    except (QueueFull, EngineClosed) as exc:
        metrics.requests.labels(endpoint, outcome(exc)).inc()
        raise failure(exc) from None
    except ContextLengthExceeded as exc:
        metrics.requests.labels(endpoint, "rejected").inc()
        raise ApiError(400, _line(exc), param="max_tokens", code="context_length_exceeded") from None
    except UserError as exc:
        metrics.requests.labels(endpoint, "rejected").inc()
        raise ApiError(400, _line(exc)) from None


class Generation:
    """Streams or collects one submitted request (``handle``) and keeps its timings."""

    def __init__(self, handle, parsed: Parsed, strategy: str, model: str, metrics, endpoint: str, arrival: float):
        self.handle, self.parsed, self.strategy = handle, parsed, strategy
        self.metrics, self.endpoint, self.arrival = metrics, endpoint, arrival
        self.builder = ResponseBuilder(parsed.kind, model)
        self.first_token: float | None = None
        self.last_token: float | None = None

    async def _pieces(self) -> AsyncIterator[str]:
        async for piece in self.handle.astream():
            if piece:
                now = time.perf_counter()
                self.first_token = self.first_token or now
                self.last_token = now
                yield piece

    def _done(self, outcome: str, result=None) -> None:
        n = len(result.token_ids) if result is not None else 0
        self.metrics.requests.labels(self.endpoint, outcome).inc()
        self.metrics.prompt_tokens.inc(int(getattr(self.handle, "prompt_tokens", 0) or 0))
        self.metrics.generation_tokens.inc(n)
        if outcome == "complete":
            self.metrics.observe_request(self.strategy, self.arrival, self.first_token, self.last_token,
                                         time.perf_counter(), n)

    async def _result(self):
        result = await self.handle.aresult()
        if result is None or self.handle.status == "interrupted":
            raise Interrupted()
        return result

    def _summary(self, result) -> tuple[dict, str, dict]:
        stats = dict(result.stats or {})
        if stats.get("trace_run_id") is None and getattr(result, "run_id", None) is not None:
            stats["trace_run_id"] = result.run_id
        use = usage(int(self.handle.prompt_tokens), len(result.token_ids), int(stats.get("prefix_cached_tokens", 0)))
        return use, finish_reason(stats.get("stop_reason")), mtpflow_field(self.strategy, stats)

    async def _until(self, request, awaitable):
        """Run ``awaitable`` unless the client disconnects first: then cancel the sequence and raise a 499."""
        work = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client left (or this task was cancelled by a shutdown timeout)
                self.handle.cancel()
                work.cancel()
                self._done("interrupted")
        if not work.done():
            raise ApiError(499, "the client closed the request", code="client_closed_request")
        return work

    def _fail(self, exc: Exception):
        """Count a request that ended before its answer and raise its ApiError (503 for a shutdown)."""
        if isinstance(exc, Interrupted):
            self._done("interrupted")
            raise _shutting_down() from None
        self._done(outcome(exc))
        raise failure(exc) from None

    async def started(self, request) -> None:
        """Wait for the first token, or for an end before it (a refusal from the queue, the deadline, a failure,
        a shutdown), which raises its ApiError: the status line is not sent before this returns."""
        await self._until(request, self.handle.astarted())
        if not self.handle.done:
            return
        try:
            await self._result()
        except Exception as exc:
            self._fail(exc)

    # ----- whole response ------------------------------------------------------------------------------------
    async def collect(self, request) -> dict:
        """Wait for the whole result; cancel the sequence if the client disconnects first."""

        async def run():
            async for _ in self._pieces():
                pass
            return await self._result()

        work = await self._until(request, run())
        try:
            result = work.result()
        except Exception as exc:
            self._fail(exc)
        self._done("complete", result)
        use, reason, extra = self._summary(result)
        return self.builder.response(result.text, reason, use, extra)

    # ----- server-sent events ------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[str]:
        """``data: {chunk}`` lines, the last chunk with finish_reason and the ``mtpflow`` figures, the usage chunk
        when asked for, then ``data: [DONE]``. Cancelled (the client went away): the sequence is cancelled."""
        b, with_usage = self.builder, self.parsed.include_usage
        finished = False
        try:
            if self.parsed.kind == "chat":
                yield sse(b.chunk(first=True, with_usage=with_usage))
            async for piece in self._pieces():
                yield sse(b.chunk(piece, with_usage=with_usage))
            result = await self._result()
            use, reason, extra = self._summary(result)
            last = b.chunk(reason=reason, with_usage=with_usage)
            last["mtpflow"] = extra
            yield sse(last)
            if with_usage:
                yield sse(b.usage_chunk(use))
            yield "data: [DONE]\n\n"
            finished = True
            self._done("complete", result)
        except Exception as exc:
            finished = True
            self._done(outcome(exc))
            err = _shutting_down() if isinstance(exc, Interrupted) else failure(exc)
            yield sse(error_body(err.message, err.type, err.param, err.code))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client disconnected or the server is cancelling requests at shutdown
                self.handle.cancel()
                self._done("interrupted")


def _shutting_down() -> ApiError:
    return ApiError(503, "the request was cancelled: the server is shutting down", type="server_error",
                    code="shutting_down", headers={"Retry-After": "5"})


async def _wait_disconnect(request) -> None:
    """Returns when the client closes the connection (the body has been read, so only disconnects arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


__all__ = ["Generation", "submit", "sse", "failure", "outcome"]
