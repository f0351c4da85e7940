"""Servers for the tests: ``python -m mtpflow.serve`` as a real process (a tiny random Llama saved to a folder,
with a chat template so chat completions work; started on a free port with its log in a file, stopped with
SIGTERM), an app served by uvicorn in a thread (``InProcessServer``), and the OpenAI client for either."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
# A minimal template in the usual shape: every turn tagged by role, then the assistant's turn opened.
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_tiny_model(folder: Path, seed: int = 0) -> Path:
    """The tests' tiny random Llama and byte-level tokenizer, saved where ``model.name=FOLDER`` loads them.
    The end-of-sequence row of the output layer is zeroed so greedy decoding never ends early: every answer
    is exactly ``max_tokens`` long, and long streams stay long enough to be cut mid-way."""
    import torch

    from helpers import make_tiny_model, make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = make_tiny_model(len(tok), seed=seed)
    with torch.no_grad():
        model.lm_head.weight[0].zero_()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class ServerProcess:
    """A started server: ``url``, ``log()``, ``stop()`` (SIGTERM, then the exit code)."""

    def __init__(self, log_path: Path, *args: str, env: dict | None = None, timeout: float = 180.0):
        self.log_path = log_path
        self._log_file = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "MTPFLOW_LOAD_PLUGINS": "", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "mtpflow.serve", "--port", "0", *args], cwd=REPO,
                                     stdout=self._log_file, stderr=subprocess.STDOUT, env=full_env)
        deadline = time.time() + timeout
        while True:
            m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", self.log())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not start (exit {self.proc.poll()}):\n{self.log()[-3000:]}")
            time.sleep(0.1)
        assert httpx.get(self.url + "/health", timeout=30).status_code == 200

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.alive:  # a test that failed half-way: never leave a server behind
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()

    def log(self) -> str:
        return self.log_path.read_bytes().decode("utf-8", "replace")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 120.0) -> int:
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._log_file.close()


def bound_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class InProcessServer:
    """uvicorn in a thread, on a socket bound before it starts (no port race)."""

    def __init__(self, app):
        import uvicorn

        self.sock = bound_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def client(url: str, api_key: str = "unused", **kwargs):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)
