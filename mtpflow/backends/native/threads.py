"""How many threads the native kernels (and torch around them) run on: all the process has, unless the CPU is shared.

The native forwards split every step between their threads and wait for all of them at each step's end (a spin
barrier, ``rows_int8.c``; OpenMP's, ``rows_float.c``). When another process takes one of the cores, a thread that
has lost its core holds every step up, while a process on one thread runs at its own speed (measured:
docs/bench/verify_cost_dec05.md#the-thread-governor-mtpflowbackendsnativethreads). So the governor watches the
decode and verify forwards (up to ``MAX_ROWS`` rows) and compares each with the fastest forward of the same kind
(the same weights, the same layers, the same row count) seen on all threads; when the median of the last ``WINDOW``
is more than ``SLOW`` times that, the process goes to one thread (``torch.set_num_threads(1)``: the kernels read
torch's count at each call) for ``BACKOFF`` forwards, then tries all threads again for ``PROBE`` forwards (back to
one thread if they are still slow). On a quiet machine the forwards stay near their fastest and nothing changes. A
process that starts while the core is already taken learns its fastest under that load and keeps all threads.

``MTPFLOW_ADAPT_THREADS=0`` turns it off (the thread count is then torch's, always).
"""
from __future__ import annotations

import os
import statistics
import threading
import weakref
from collections import deque

import torch

WINDOW = 16  # forwards whose median decides: one slow forward (a page fault, an interrupt) decides nothing
SLOW = 1.6  # the median over the fastest that says a core is taken (above a quiet machine's spread, below a taken core's)
BACKOFF = 256  # forwards on one thread before all threads are tried again (a second or two at batch 1)
PROBE = 8  # forwards on all threads that decide whether the core is still taken (each one slow while it is)
MAX_ROWS = 32  # decode and verify forwards; a prefill chunk's time depends on more than its rows


class ThreadGovernor:
    """The thread count for the next native forward (``threads``) and what the last one took (``observe``)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = os.environ.get("MTPFLOW_ADAPT_THREADS", "1") != "0" if enabled is None else enabled
        self.full = 0  # the process's thread count while it is not backing off (torch's, read at each call)
        self.left = 0  # forwards still to run on one thread
        # model -> {(kind, rows): the fastest forward seen on all threads} (weakly: a model gone takes its figures)
        self.fastest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.ratios: deque[float] = deque(maxlen=WINDOW)
        self.probing = False  # back from one thread: the next PROBE forwards decide
        self.switches = 0  # times it went to one thread (for the tests and the docs' runs)
        self._lock = threading.Lock()

    def threads(self) -> int:
        """The threads the next forward runs on (and torch's count now)."""
        if not self.enabled or self.left == 0:
            self.full = torch.get_num_threads()
            return self.full
        return 1

    def observe(self, model, rows: int, seconds: float, threads: int, kind=None) -> None:
        """A forward of ``rows`` rows of ``model`` took ``seconds`` on ``threads`` threads. ``model``: an object that
        stands for the weights run; ``kind``: what else sets the forward's cost (a draft through the int8 copy, the
        first N layers only). Each forward is compared with the fastest of its own model, kind and rows."""
        if not self.enabled or rows > MAX_ROWS or threads <= 1 and self.left == 0:
            return
        with self._lock:
            if self.left:
                self.left -= 1
                if self.left == 0:  # try all threads again, from a clean window
                    torch.set_num_threads(self.full)
                    self.ratios.clear()
                    self.probing = True
                return
            fastest = self.fastest.setdefault(model, {})
            best = fastest.get((kind, rows))
            if best is None or seconds < best:
                fastest[kind, rows] = best = seconds
            self.ratios.append(seconds / best)
            decide = PROBE if self.probing else WINDOW
            if len(self.ratios) < decide:
                return
            if statistics.median(self.ratios) > SLOW:
                self.left = BACKOFF
                self.switches += 1
                self.ratios.clear()
                torch.set_num_threads(1)
            self.probing = False


GOVERNOR = ThreadGovernor()
