"""The FastAPI app of ``python -m mtpflow.serve``: OpenAI-compatible ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models`` on an engine, plus ``/health`` and ``/metrics``.

Strategy per request: ``{"mtpflow": {"strategy": "mtp", "overrides": {...}}}`` in the body (``extra_body`` in
the OpenAI client), or a strategy-named model id ``<model>:<strategy>`` from ``GET /v1/models``; the plain
model id means the server's default strategy. Every error is an OpenAI error object with a 4xx status for
the client's mistakes; nothing answers with a traceback.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtpflow.serve import openapi
from mtpflow.serve.generation import Generation, submit
from mtpflow.serve.metrics import ServerMetrics
from mtpflow.serve.protocol import ApiError, bad, error_body, parse

MAX_BODY_BYTES = 8 << 20
log = logging.getLogger("mtpflow.serve")


class ServerState:
    """What the routes share: the engine and the settings the server was started with."""

    def __init__(self, engine, served_model: str, default_strategy: str, api_key: str | None, store,
                 retention=None):
        self.engine, self.served_model, self.default_strategy = engine, served_model, default_strategy
        self.api_key = api_key or None
        self.store, self.retention = store, retention
        self.metrics = ServerMetrics(engine, store)
        self.draining = False  # set on SIGTERM: new requests get 503 while the running ones finish
        self.shut_down = False  # the engine was shut down (the app's lifespan ended)
        self.strategies = list(engine.strategies())
        self.started = int(time.time())

    def model_ids(self) -> list[str]:
        return [self.served_model] + [f"{self.served_model}:{s}" for s in self.strategies]

    def resolve(self, model: str, strategy: str | None) -> str | None:
        """The strategy a request asks for (None: the default), from its model id and ``mtpflow.strategy``."""
        from_model = None
        if model and model != self.served_model:
            head, _, tail = model.rpartition(":")
            if head != self.served_model or tail not in self.strategies:
                shown = ", ".join(self.model_ids()[:6]) + (", ..." if len(self.model_ids()) > 6 else "")
                raise ApiError(404, f"the model {model!r} does not exist; GET /v1/models lists them: {shown}",
                               param="model", code="model_not_found")
            from_model = tail
        if strategy is not None and strategy not in self.strategies:
            raise bad("mtpflow.strategy", f"unknown strategy {strategy!r}; available: {', '.join(self.strategies)}",
                      code="unknown_strategy")
        if strategy and from_model and strategy != from_model:
            raise bad("mtpflow.strategy", f"the model id names strategy {from_model!r} but mtpflow.strategy is "
                                          f"{strategy!r}")
        return strategy or from_model


class EndCancelledRequests:
    """ASGI middleware: past ``--drain-timeout`` uvicorn cancels the requests still open. Their sequences are
    already cancelled (recorded ``interrupted``) by then; this ends each response properly instead of leaving a
    traceback in the log: a 503 error object, or an ``error`` event on a stream that had started."""

    def __init__(self, app, state: "ServerState"):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent: set[str] = set()  # "start" once the status line went out, "end" once the body is complete

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                sent.add("start")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent.add("end")
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not self.state.draining:
                raise
            log.warning("%s cancelled: the drain timeout passed", scope.get("path"))
            if "end" in sent:
                return
            err = error_body("the server shut down before this request finished", "server_error",
                             code="shutting_down")
            if "start" not in sent:
                body = json.dumps(err).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5")]})
                await send({"type": "http.response.body", "body": body})
            else:
                await send({"type": "http.response.body", "more_body": False,
                            "body": f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()})


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(engine, *, served_model: str, default_strategy: str, api_key: str | None = None, store=None,
               retention=None) -> FastAPI:
    """The app for ``engine``. ``store``: the trace store whose metrics ``/metrics`` adds; ``retention`` runs in a
    thread while serving. Shutting the app down drains the engine."""
    state = ServerState(engine, served_model, default_strategy, api_key, store, retention)

    @asynccontextmanager
    async def lifespan(_app):
        if retention is not None:
            retention.start()
        try:
            yield
        finally:
            state.draining = True
            # uvicorn has already waited for the open requests (or cancelled them past the drain timeout)
            await anyio.to_thread.run_sync(lambda: engine.shutdown(drain=True))
            state.shut_down = True
            try:
                if retention is not None:
                    retention.stop()
                if store is not None:
                    store.checkpoint("TRUNCATE")  # leave one file: every run is in the database proper
            except Exception as exc:  # the database stays consistent (WAL); only the tidying failed
                log.warning("trace database not checkpointed at shutdown: %s", str(exc).splitlines()[0])

    # the schema (GET /openapi.json) declares every answer, so a fuzzer can hold the server to it
    app = FastAPI(title="mtpflow", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.mtpflow = state
    bodies = openapi.request_bodies(state.model_ids(), state.strategies)
    default_openapi = app.openapi

    def schema() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi.drop_validation_errors(default_openapi())
        return app.openapi_schema

    app.openapi = schema
    app.add_middleware(EndCancelledRequests, state=state)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        return JSONResponse(error_body(f"invalid request: {exc.errors()[0].get('msg', '')}"), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        log.error("internal error", exc_info=(type(exc), exc, exc.__traceback__))
        return JSONResponse(error_body("internal server error; see the server log", "server_error"),
                            status_code=500)

    def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            endpoint = request.url.path
            if endpoint in ("/v1/chat/completions", "/v1/completions"):
                state.metrics.requests.labels(endpoint, "unauthorized").inc()
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health", openapi_extra=openapi.errors("503"))
    async def health():
        body = {"status": "draining" if state.draining else "ok", "running": engine.num_running,
                "waiting": engine.num_waiting}
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/metrics", response_class=Response, openapi_extra={"responses": {"200": {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}})
    def metrics():  # a plain def: FastAPI runs it in a thread, the trace queries never block the event loop
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(model_id: str) -> dict:
        strategy = model_id.rpartition(":")[2] if model_id != state.served_model else state.default_strategy
        return {"id": model_id, "object": "model", "created": state.started, "owned_by": "mtpflow",
                "mtpflow": {"strategy": strategy, "default": model_id == state.served_model}}

    @app.get("/v1/models", dependencies=[Depends(authorized)], openapi_extra=openapi.errors("401"))
    async def models():
        return {"object": "list", "data": [model_card(m) for m in state.model_ids()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)],
             openapi_extra=openapi.errors("400", "401", "404"))
    async def model(model_id: str):
        if model_id not in state.model_ids():
            raise ApiError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return model_card(model_id)

    async def complete(kind: str, request: Request):
        arrival = time.perf_counter()
        endpoint = request.url.path
        try:
            parsed, strategy = await _read(kind, request, state)
        except ApiError:
            state.metrics.requests.labels(endpoint, "rejected").inc()
            raise
        if state.draining:
            state.metrics.requests.labels(endpoint, "unavailable").inc()
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                           headers={"Retry-After": "5"})
        from mtpflow.request import Request as EngineRequest

        handle = await submit(engine, EngineRequest(strategy=strategy, **parsed.request), state.metrics, endpoint)
        gen = Generation(handle, parsed, strategy or state.default_strategy, parsed.model or state.served_model,
                         state.metrics, endpoint, arrival)
        try:
            await gen.started(request)  # a refusal or failure before the first token keeps its own status
            if parsed.stream:
                return StreamingResponse(gen.events(), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return JSONResponse(await gen.collect(request))
        except ApiError as exc:
            return _error(exc)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)],
              openapi_extra=openapi.completion_route(bodies["chat"]))
    async def chat_completions(request: Request):
        return await complete("chat", request)

    @app.post("/v1/completions", dependencies=[Depends(authorized)],
              openapi_extra=openapi.completion_route(bodies["completion"]))
    async def completions(request: Request):
        return await complete("completion", request)

    return app


async def _read(kind: str, request: Request, state: ServerState):
    """The parsed body and the strategy it asks for, or an ApiError (400/404/413)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MB", code="body_too_large")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MB", code="body_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(None, f"the body is not valid JSON ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise bad(None, "the body is nested too deeply") from None
    parsed = parse(kind, body)
    return parsed, state.resolve(parsed.model, parsed.strategy)


__all__ = ["MAX_BODY_BYTES", "EndCancelledRequests", "ServerState", "create_app"]
