"""Trace retention: caps on the number of recorded runs, their age and the database size (``trace.retention``),
enforced after runs finish: by a background thread in the server (``start``), inline after each run otherwise.

The oldest finished runs go first, whole (run row, steps, token events); a run still being recorded is never
deleted. The size cap counts the database file plus its write-ahead log. The log gets a tenth of the cap (at
most SQLite's usual 4 MiB) and room for three times that, since a checkpoint can miss its moment while two
threads write; past the rest of 90 % of the cap, runs are deleted until live pages take 10 points less, and
the freed pages are reused by later writes, so the file stops growing without a VACUUM. Deletions go in small
transactions so a writer never waits long for the lock. Should the thread fall behind (runs finishing faster
than it deletes), the recorder that finds the files past 90 % of the cap enforces before its run ends:
back-pressure, not overflow.
"""
from __future__ import annotations

import math
import sys
import threading
import time

from mtpflow.errors import ConfigError, check_int, check_range
from mtpflow.traces.store import TraceStore

HARD_WATER = 0.9  # files past this share of the cap: the finishing run's thread enforces at once
LOG_ROOM = 3  # write-ahead logs' worth of the cap kept free below HARD_WATER
STEP = 0.1  # share of the cap freed at once, below the point where deleting starts
CHUNK = 20  # runs deleted per transaction


class TraceRetention:
    """Deletes the oldest finished runs past ``max_runs``, older than ``max_age_hours`` or while the database
    is over ``max_mb``. Thread-safe; ``deleted`` counts the runs this process removed."""

    def __init__(self, store: TraceStore, max_runs: int | None = None, max_age_hours: float | None = None,
                 max_mb: float | None = None):
        self.store = store
        self.max_runs = None if max_runs is None else check_int("trace.retention.max_runs", max_runs, 1)
        self.max_age_hours = (None if max_age_hours is None else
                              float(check_range("trace.retention.max_age_hours", max_age_hours, 0, None, False)))
        self.max_bytes = (None if max_mb is None else
                          int(float(check_range("trace.retention.max_mb", max_mb, 0, None, False)) * (1 << 20)))
        if self.max_bytes is not None:
            if self.max_bytes < 256 << 10:
                raise ConfigError(f"trace.retention.max_mb must be at least 0.25 (an empty trace database takes "
                                  f"about 0.1 MB), got {max_mb!r}")
            # the write-ahead log gets a tenth of the cap (at most SQLite's usual 4 MiB)
            store.wal_limit_bytes = min(store.wal_limit_bytes, max(64 << 10, self.max_bytes // 10))
            # live pages may take the cap less room for the log: deleting starts at ``high``, stops at ``low``
            self.high = HARD_WATER - LOG_ROOM * store.wal_limit_bytes / self.max_bytes
            self.low = self.high - STEP
        self.deleted = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.max_runs, self.max_age_hours, self.max_bytes))

    def describe(self) -> str:
        parts = [f"{self.max_runs} runs" if self.max_runs else "",
                 f"{self.max_age_hours:g} h" if self.max_age_hours is not None else "",
                 f"{self.max_bytes / (1 << 20):g} MB" if self.max_bytes else ""]
        return ", ".join(p for p in parts if p) or "none"

    # ----- when -------------------------------------------------------------------------------------------
    def run_finished(self) -> None:
        """Called by the recorder after a run's last write: wakes the background thread, or enforces now."""
        if not self.active:
            return
        if self.max_bytes is not None:
            try:
                if _wal_bytes(self.store) > self.store.wal_limit_bytes:
                    # this thread is the one that writes, so the log empties at once (readers are brief)
                    self.store.checkpoint("TRUNCATE", wait_seconds=0.05)
            except Exception:  # the retention pass below reports database trouble
                pass
            if self.store.file_bytes() > HARD_WATER * self.max_bytes:
                self._enforce_quietly()
                return
        if self._thread is None:
            self._enforce_quietly()
        else:
            self._wake.set()

    def start(self, interval_seconds: float = 60.0) -> None:
        """Enforce from a daemon thread: after every finished run and every ``interval_seconds`` (the age cap
        also applies while idle)."""
        if not self.active or self._thread is not None:
            return
        self._stopping = False

        def loop():
            while not self._stopping:
                self._wake.wait(interval_seconds)
                self._wake.clear()
                if not self._stopping:
                    self._enforce_quietly()

        self._thread = threading.Thread(target=loop, name="mtpflow-trace-retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, then enforce once more so the database is within its caps when the server ends."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping = True
            self._wake.set()
            thread.join()
        if self.active:
            self._enforce_quietly()

    # ----- what -------------------------------------------------------------------------------------------
    def enforce(self) -> int:
        """Apply every cap now; the number of runs deleted."""
        with self._lock:
            n = self._by_age() + self._by_count() + self._by_size()
            self.deleted += n
            return n

    def _enforce_quietly(self) -> None:
        try:
            self.enforce()
        except Exception as exc:  # retention must never break a decode or the server
            msg = str(getattr(exc, "orig", None) or exc).strip().splitlines()
            print(f"mtpflow: warning: trace retention failed ({type(exc).__name__}: {msg[0] if msg else ''}); "
                  "it is tried again after the next run", file=sys.stderr)

    def _delete(self, ids: list[int]) -> int:
        """Delete in chunks. A deletion writes the pages it changes to the log, so with a size cap a chunk
        frees at most half the log's share and the log is emptied between chunks."""
        store, done = self.store, 0
        chunk = CHUNK
        if self.max_bytes is not None and ids:
            runs = max(1, store.count("runs"))
            chunk = max(1, min(CHUNK, int(store.wal_limit_bytes / 2 / max(1.0, store.used_bytes() / runs))))
        for i in range(0, len(ids), chunk):
            done += store.delete_runs(ids[i:i + chunk])
            if self.max_bytes is not None and _wal_bytes(store) > store.wal_limit_bytes:
                store.checkpoint("TRUNCATE", wait_seconds=0.2)
        return done

    def _by_age(self) -> int:
        if self.max_age_hours is None:
            return 0
        cutoff = time.time() - self.max_age_hours * 3600.0
        total = 0
        while ids := self.store.finished_run_ids(CHUNK * 10, started_before=cutoff):
            n = self._delete(ids)
            if not n:
                break
            total += n
        return total

    def _by_count(self) -> int:
        if self.max_runs is None:
            return 0
        excess = self.store.count("runs") - self.max_runs
        return self._delete(self.store.finished_run_ids(excess)) if excess > 0 else 0

    def _by_size(self) -> int:
        if self.max_bytes is None:
            return 0
        store, total = self.store, 0
        used = store.used_bytes()
        if used > self.high * self.max_bytes:
            for _ in range(8):  # converges in one or two rounds; bounded in case runs differ wildly in size
                runs = store.count("runs")
                if used <= self.low * self.max_bytes or not runs:
                    break
                want = max(1, math.ceil((used - self.low * self.max_bytes) / (used / runs)))
                n = self._delete(store.finished_run_ids(want))
                if not n:
                    break
                total += n
                used = store.used_bytes()
        if _wal_bytes(store) > store.wal_limit_bytes:
            # readers kept SQLite's own checkpoints from restarting the log: empty it, waiting a moment at most
            # (a checkpoint holds writers back while it waits)
            store.checkpoint("TRUNCATE", wait_seconds=0.2)
        return total


def _wal_bytes(store: TraceStore) -> int:
    try:
        return store.path.with_name(store.path.name + "-wal").stat().st_size
    except OSError:
        return 0


def retention_from_config(store: TraceStore, trace_cfg) -> TraceRetention:
    """``trace.retention`` (max_runs, max_age_hours, max_mb; each null = no cap) for ``store``."""
    node = (trace_cfg.get("retention") if trace_cfg is not None else None) or {}
    known = {"max_runs", "max_age_hours", "max_mb"}
    unknown = set(node.keys()) - known
    if unknown:
        raise ConfigError(f"unknown trace.retention setting(s) {', '.join(sorted(unknown))}; known: "
                          f"{', '.join(sorted(known))}")
    return TraceRetention(store, node.get("max_runs"), node.get("max_age_hours"), node.get("max_mb"))


__all__ = ["TraceRetention", "retention_from_config"]
