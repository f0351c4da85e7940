"""Releasing a waiting thread's OpenMP workers (mtpflow.kernels.openmp) and where the engine does it."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from helpers import make_pipeline, tiny_loaded
from mtpflow.backends.native import openmp


def _threads() -> set[str]:
    """The process's thread ids (other tests' threads may come and go meanwhile: compare sets, not counts)."""
    return set(os.listdir("/proc/self/task"))


def _gone(tids: set[str], timeout: float = 2.0) -> bool:
    """Whether every thread in ``tids`` has ended (a released worker may take a moment to leave /proc)."""
    deadline = time.monotonic() + timeout
    while tids & _threads():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.skipif(not openmp.available() or not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="needs libgomp, /proc and at least 2 torch threads")
def test_release_ends_the_calling_threads_workers_and_work_goes_on():
    x = torch.randn(1 << 22)
    ref = (x * 2).sum()
    out = {}

    def body():  # a fresh thread: its first parallel region starts its own worker pool
        before = _threads()
        (x * 2).sum()
        out["workers"] = _threads() - before
        out["released"] = openmp.release_workers()
        out["gone"] = _gone(out["workers"])
        out["same"] = torch.equal((x * 2).sum(), ref)  # the next region starts a new pool

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert out["released"] and out["same"], out
    assert out["workers"] and out["gone"], out  # the thread had workers, and the release ended them


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
