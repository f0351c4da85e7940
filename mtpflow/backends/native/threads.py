"""How many threads the native kernels (and torch around them) run on: all the process has, unless the CPU is shared.

The native forwards split every step between their threads and wait for all of them at each step's end (a spin
barrier, ``rows_int8.c``; OpenMP's, ``rows_float.c``). When another process takes one of the cores, a thread that
has lost its core holds every step up, while a process on one thread runs at its own speed (measured:
docs/bench/verify_cost_dec05.md#the-thread-governor-mtpflowbackendsnativethreads). So the governor watches the
decode and verify forwards (up to ``MAX_ROWS`` rows) and picks the thread count by measuring both:
- a quick switch: on all threads each forward is compared with the fastest forward of the same kind (the same
  weights, the same layers, the same row count) seen on all threads; when the median of the last ``WINDOW`` is more
  than ``SLOW`` times that, the process goes to one thread (``torch.set_num_threads(1)``: the kernels read the count
  the governor gives them at each call, torch its own);
- trials: after its first ``WINDOW`` forwards, then every ``EXPLORE`` forwards on all threads (every ``BACKOFF`` on
  one), the process runs ``PROBE`` forwards on the other count (torch's count too, during each of them) and
  compares each with the median of the last forwards of the same kind on the count it has; it changes count when
  the other is faster by ``KEEP``'s margin. A process that starts while a core is already taken learns its fastest
  under that load, so the quick switch never fires there: the trials find the faster count anyway (before them,
  such a process kept both threads and ran at half the speed of one). On a quiet machine a trial is ``PROBE``
  slower forwards in ``EXPLORE``, about 1%.

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
BACKOFF = 256  # forwards on one thread between trials of all threads (a second or two at batch 1)
EXPLORE = 512  # forwards on all threads between trials of one thread (each trial costs PROBE slower forwards)
PROBE = 8  # forwards of a trial on the other count
KEEP = 0.9  # the other count's median time over this one's, below which the trial switches (noise never gets there)
MIN_BASE = 3  # forwards of a kind on the count in use before a trial forward of that kind is compared with them
MAX_ROWS = 32  # decode and verify forwards; a prefill chunk's time depends on more than its rows


class ThreadGovernor:
    """The thread count for the next native forward (``threads``) and what the last one took (``observe``)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = os.environ.get("MTPFLOW_ADAPT_THREADS", "1") != "0" if enabled is None else enabled
        self.full = 0  # the process's thread count while it is not on one thread (torch's, read at each call)
        self.one = False  # on one thread (the count in use, outside a trial)
        self.trial = 0  # forwards still to run on the other count
        self.trial_ratios: list[float] = []
        self.count = 0  # forwards on the count in use since the last trial or switch
        # model -> {(kind, rows): the fastest forward seen on all threads} (weakly: a model gone takes its figures)
        self.fastest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # model -> {(kind, rows, on one thread): the last forwards' seconds}
        self.recent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.ratios: deque[float] = deque(maxlen=WINDOW)
        self.switches = 0  # times it went to one thread (for the tests and the docs' runs)
        self.trials = 0  # trials run (the first comes after WINDOW forwards)
        self._lock = threading.Lock()

    def _on_one(self) -> bool:
        return self.one != (self.trial > 0)  # a trial runs the other count

    def threads(self, forward: bool = True) -> int:
        """The threads the next forward runs on. A trial's forward (``forward``: the call before a forward that
        ``observe`` then reports) also sets torch's count to it, so the forward's torch parts run as they would on
        that count; ``observe`` sets it back. ``forward=False``: the count only (work outside a timed forward)."""
        if not self.enabled:
            return torch.get_num_threads()
        if not self.one and not self.trial:
            self.full = torch.get_num_threads()
        n = 1 if self._on_one() else self.full
        if forward and self.trial and torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def _apply(self) -> None:
        """torch's count back to the count in use, never a trial's between forwards: a request that ends inside a
        trial leaves torch (the HF backend, the bench's HF ``generate`` in the same process) on the process's count."""
        torch.set_num_threads(1 if self.one else self.full)

    def observe(self, model, rows: int, seconds: float, threads: int, kind=None) -> None:
        """A forward of ``rows`` rows of ``model`` took ``seconds`` on ``threads`` threads. ``model``: an object that
        stands for the weights run; ``kind``: what else sets the forward's cost (a draft through the int8 copy, the
        first N layers only). Each forward is compared with forwards of its own model, kind and rows."""
        if not self.enabled:
            return
        if rows > MAX_ROWS or self.full <= 1 or threads > 1 and threads != self.full:
            if self.trial:  # a prefill chunk inside a trial: not compared, torch's count back all the same
                self._apply()
            return
        key, on_one = (kind, rows), threads == 1
        with self._lock:
            recent = self.recent.setdefault(model, {})
            mine = recent.setdefault((*key, on_one), deque(maxlen=WINDOW))
            if self.trial:
                base = recent.get((*key, not on_one))
                if base is not None and len(base) >= MIN_BASE:
                    self.trial_ratios.append(seconds / statistics.median(base))
                mine.append(seconds)
                self.trial -= 1
                if self.trial == 0:
                    if self.trial_ratios and statistics.median(self.trial_ratios) < KEEP:
                        self.one = not self.one
                        self.switches += self.one
                    self.count = 0
                    self.ratios.clear()
                self._apply()
                return
            mine.append(seconds)
            self.count += 1
            if not self.one:  # the quick switch: far slower than the fastest seen on all threads
                fastest = self.fastest.setdefault(model, {})
                best = fastest.get(key)
                if best is None or seconds < best:
                    fastest[key] = best = seconds
                self.ratios.append(seconds / best)
                if len(self.ratios) >= WINDOW and statistics.median(self.ratios) > SLOW:
                    self.one, self.count = True, 0
                    self.switches += 1
                    self.ratios.clear()
                    self._apply()
                    return
            due = WINDOW if not self.trials else (BACKOFF if self.one else EXPLORE)  # the first after WINDOW
            if self.count >= due:
                self.trials += 1
                self.trial, self.trial_ratios = PROBE, []


GOVERNOR = ThreadGovernor()
