"""Releasing a waiting thread's OpenMP workers (mtpflow.kernels.openmp) and where the engine does it."""
from __future__ import annotations

import threading
import time

import torch

from helpers import make_pipeline, tiny_loaded
from mtpflow.kernels import openmp


def test_release_then_parallel_work_is_unchanged():
    x = torch.randn(512, 512)
    ref = x @ x  # a parallel region: this thread now has a worker pool
    released = openmp.release_workers()
    assert released == openmp.available()  # torch on Linux loads libgomp; elsewhere it is a no-op
    assert torch.equal(x @ x, ref)  # the next region starts a new pool
    out = []
    worker = threading.Thread(target=lambda: out.append(openmp.release_workers() == openmp.available() and
                                                        torch.equal(x @ x, ref)))
    worker.start()
    worker.join()
    assert out == [True]


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("MTPFLOW_OPENMP_RELEASE", "0")
    openmp._pause.cache_clear()
    try:
        assert openmp.available() is False and openmp.release_workers() is False
    finally:
        monkeypatch.delenv("MTPFLOW_OPENMP_RELEASE")
        openmp._pause.cache_clear()


def test_the_submitting_thread_and_the_idle_engine_release_their_workers(monkeypatch):
    calls = []
    monkeypatch.setattr(openmp, "release_workers", lambda: calls.append(threading.current_thread().name) or True)
    pipe = make_pipeline(tiny_loaded(seed=3), "baseline", "max_new_tokens=4")
    pipe(prompt_ids=list(range(5, 15)))
    assert threading.current_thread().name in calls  # the caller, before it waits
    deadline = time.monotonic() + 10  # the engine thread goes idle just after it hands over the result
    while time.monotonic() < deadline and all(name == threading.current_thread().name for name in calls):
        time.sleep(0.01)
    assert any(name != threading.current_thread().name for name in calls)  # the engine thread, idle
