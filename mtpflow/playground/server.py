"""Serve the playground: a FastAPI app holding ``/metrics`` (Prometheus text format) with the Gradio page
mounted at ``/``, run by uvicorn in the foreground (the command) or on a background thread (tests).

Gradio 6 takes the theme and CSS at launch/mount time, not on ``gr.Blocks``.
"""
from __future__ import annotations

import hmac
import socket
import threading
import time
from pathlib import Path
from typing import Callable

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


def read_users(path) -> dict[str, str]:
    """A users file: one ``user:password`` a line (the password may hold ``:``); blank lines and ``#`` comments
    skipped. UserError for a missing file, a malformed line or no user at all."""
    from mtpflow.errors import UserError

    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read the users file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    users = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, password = line.partition(":")
        if not sep or not user.strip() or not password:
            raise UserError(f"{path}, line {number}: expected user:password")
        users[user.strip()] = password
    if not users:
        raise UserError(f"{path} names no user (one user:password a line)")
    return users


def login_check(users: dict[str, str] | None = None, api_key: str | None = None) -> Callable[[str, str], bool] | None:
    """Gradio's ``auth`` callable: a listed user with their password, or (``api_key`` set) any user name with the
    server's API key as the password; compared in constant time. None when neither is given (no login)."""
    if not users and not api_key:
        return None
    accounts = {u.encode(): p.encode() for u, p in (users or {}).items()}
    key = api_key.encode() if api_key else None

    def check(username: str, password: str) -> bool:
        given = (password or "").encode()
        listed = accounts.get((username or "").encode())
        ok_user = listed is not None and hmac.compare_digest(given, listed)
        ok_key = key is not None and hmac.compare_digest(given, key)
        return ok_user or ok_key

    return check


def create_server_app(blocks: gr.Blocks, store=None, auth: Callable[[str, str], bool] | None = None) -> FastAPI:
    """``/metrics`` from ``store`` (a TraceStore, or None) plus the page at ``/``, behind Gradio's login page when
    ``auth`` is given (``login_check``). ``/metrics`` stays open, as the server's does."""
    from prometheus_client import CONTENT_TYPE_LATEST

    app = FastAPI(title="mtpflow playground")

    @app.get("/metrics")
    def metrics():  # a route declared before the Gradio mount, so "/" does not shadow it
        return PlainTextResponse(metrics_text(store), media_type=CONTENT_TYPE_LATEST)

    login = {} if auth is None else {"auth": auth, "auth_message": "mtpflow playground: log in to compare strategies"}
    return gr.mount_gradio_app(app, blocks, path="/", theme=gr.themes.Soft(), css=CSS, footer_links=["api"], **login)


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
