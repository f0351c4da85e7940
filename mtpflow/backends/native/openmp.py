"""Release a thread's idle OpenMP workers, so the thread that decodes keeps its workers spinning.

Why: torch's CPU ops and the native kernel (gemm.c, rows_float.c) run their parallel regions on libgomp, which
gives every thread that starts a parallel region its own team of worker threads, kept for the thread's
life. The engine decodes in its own thread while the caller (a script's main thread that loaded the model,
ran ``model.generate``, ...) waits; the caller's idle workers still count as threads libgomp manages, and
once they outnumber the CPUs libgomp throttles how long every worker spins before it sleeps (``do_spin``
takes its throttled spin count), so the decoding thread's workers fall asleep between the parallel regions of a
forward (211 native linear calls for the default model, plus torch's own) and are woken each time: native
linears in a second thread run slower than in the main thread, and as fast once the main thread has released
its workers (``python scripts/probe_openmp.py 8``; measured: docs/bench/code-figures.md#openmp-module-docstring).

How: ``release_workers()`` calls ``omp_pause_resource_all(omp_pause_soft)`` (OpenMP 5.0), which ends the
calling thread's pool; libgomp starts a new one (new worker threads) at the thread's next parallel region.
The engine calls it in the caller's thread before that thread blocks on a result, and in its own thread when
it goes idle. Only a libgomp that is already loaded is used (torch loads one); with none, or an older one
without the call, it does nothing.
"""
from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1


@functools.lru_cache(maxsize=1)
def _pause():
    if os.environ.get("MTPFLOW_OPENMP_RELEASE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        fn = lib.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def available() -> bool:
    """Whether a loaded libgomp offers ``omp_pause_resource_all``."""
    return _pause() is not None


def release_workers() -> bool:
    """End the calling thread's idle OpenMP worker pool (a no-op inside a parallel region, or without
    libgomp); True when libgomp did it."""
    fn = _pause()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0
