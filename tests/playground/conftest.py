"""Fixtures for the playground tests: the real ``python -m mtpflow.playground`` on the default model in a
subprocess (one per session), an in-process server on the tiny model with a strategy that fails mid-decode,
and headless Chromium through Playwright."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def wait_for_http(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the playground exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the playground did not answer on {url} within {timeout:.0f} s")


@pytest.fixture(scope="session")
def playground(tmp_path_factory):
    """``python -m mtpflow.playground`` on a free port, default model, its own trace database (url, db)."""
    from mtpflow.playground.server import free_port

    port = free_port()
    db = tmp_path_factory.mktemp("playground") / "traces.db"
    log = tmp_path_factory.mktemp("playground-log") / "server.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mtpflow.playground", "--port", str(port), "--max-tokens",
                                 "256", f"trace.db={db}"], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for_http(url, proc, timeout=600)  # a fresh measurement cache times the CPU linear plans first
        yield SimpleNamespace(url=url, db=db, log=log)
    except RuntimeError as exc:
        pytest.fail(f"{exc}; server log:\n{log.read_text()[-3000:]}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def playground_url(playground):
    return playground.url


@pytest.fixture(scope="session")
def chromium():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium); browser tests need it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture()
def page(chromium):
    context = chromium.new_context(viewport={"width": 1500, "height": 1300})
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    context.close()
