"""Serve the playground: a FastAPI app holding ``/metrics`` (Prometheus text format) with the Gradio page
mounted at ``/``, run by uvicorn in the foreground (the command) or on a background thread (tests).

Gradio 6 takes the theme and CSS at launch/mount time, not on ``gr.Blocks``.
"""
from __future__ import annotations

import socket
import threading
import time

import gradio as gr
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from mtpflow.playground.render import CSS


def metrics_text(store) -> bytes:
    """The Prometheus exposition: the trace store's metrics (aggregated per strategy over every recorded run),
    or this process's default registry when tracing is off."""
    if store is not None:
        from mtpflow.traces.metrics import exposition

        return exposition(store)
    from prometheus_client import generate_latest

    return generate_latest()


def create_server_app(blocks: gr.Blocks, store=None) -> FastAPI:
    """``/metrics`` from ``store`` (a TraceStore, or None) plus the page at ``/``."""
    from prometheus_client import CONTENT_TYPE_LATEST

    app = FastAPI(title="mtpflow playground")

    @app.get("/metrics")
    def metrics():  # a route declared before the Gradio mount, so "/" does not shadow it
        return PlainTextResponse(metrics_text(store), media_type=CONTENT_TYPE_LATEST)

    return gr.mount_gradio_app(app, blocks, path="/", theme=gr.themes.Soft(), css=CSS, footer_links=["api"])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """uvicorn on a daemon thread; ``url`` once ``start()`` returns, ``stop()`` to shut down."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="playground-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the playground server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
