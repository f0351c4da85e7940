"""Fixtures for the server tests: an in-process server on a fake engine (fast protocol tests). The helpers for
real server processes are in ``server_process.py`` (a plain module: several conftest.py files share one name)."""
from __future__ import annotations

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")


@pytest.fixture
def fake_server():
    """``make(api_key=None, **engine_kwargs)`` -> a started in-process server (``.url``, ``.engine``, ``.app``)."""
    from fake_engine import FakeEngine
    from server_process import InProcessServer

    from mtpflow.serve.app import create_app

    started = []

    def make(api_key=None, **engine_kwargs):
        engine = FakeEngine(**engine_kwargs)
        app = create_app(engine, served_model="fake", default_strategy="pld", api_key=api_key)
        srv = InProcessServer(app).__enter__()
        srv.engine, srv.app = engine, app
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.__exit__(None, None, None)
