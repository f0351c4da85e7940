"""``mtpflow.model.cached_timing``: the one mechanism behind the per-machine timings (CPU linear plans, verify-cost
curves, the batch-cost grid): measured once and kept; a timing taken on a busy CPU is used by its run and taken
again by a later load that finds the CPU quiet, at most BUSY_RETRIES times."""
from __future__ import annotations

import json
import os

import pytest

from mtpflow.model import BUSY_RETRIES, cached_timing


@pytest.fixture()
def cpu(monkeypatch):
    """The 1-minute load average the mechanism reads (settable), quiet to start with."""
    load = {"now": 0.1}
    monkeypatch.setattr(os, "getloadavg", lambda: (load["now"], 0.1, 0.1))
    return load


def timer(*runs):
    """measure() returning each of ``runs`` in turn, counting the calls."""
    it, calls = iter(runs), []

    def measure():
        calls.append(1)
        return next(it)

    return measure, calls


def parse(stored):
    return stored["fastest"]


def record(fastest):
    return fastest, {"fastest": fastest}


QUIET = {"a": [1.0, 1.1, 1.05], "b": [2.0, 2.1, 2.2]}  # repeats within 1.1x
NOISY = {"a": [0.5, 1.6, 1.7], "b": [2.0, 2.1, 2.2]}  # one case's median 3.2x its fastest


def test_measured_once_then_cached(tmp_path, cpu):
    path = tmp_path / "kind" / "t.json"
    measure, calls = timer(QUIET)
    assert cached_timing(path, parse, measure, record) == ({"a": 1.0, "b": 2.0}, "measured")  # the fastest
    assert cached_timing(path, parse, measure, record) == ({"a": 1.0, "b": 2.0}, "cached") and len(calls) == 1
    stored = json.loads(path.read_text())
    assert stored["busy"] is False and stored["spread"] == pytest.approx(1.05, abs=0.01)
    path.write_text("{damaged")
    measure, calls = timer(QUIET)
    assert cached_timing(path, parse, measure, record)[1] == "measured"  # a damaged record is timed again


def test_a_busy_timing_is_used_then_taken_again_when_the_cpu_is_quiet(tmp_path, cpu, capsys):
    path = tmp_path / "kind" / "t.json"
    measure, calls = timer(*[NOISY] * (BUSY_RETRIES + 1), QUIET)
    assert cached_timing(path, parse, measure, record) == ({"a": 0.5, "b": 2.0}, "measured")  # this run uses it
    assert "busy" in capsys.readouterr().err and json.loads(path.read_text())["busy"] is True
    cpu["now"] = 40.0  # still busy: the marked timing serves, nothing is timed now
    assert cached_timing(path, parse, measure, record)[1] == "cached" and len(calls) == 1
    cpu["now"] = 0.1  # quiet: timed again, busy again each time until the retries are spent
    for n in range(BUSY_RETRIES):
        assert cached_timing(path, parse, measure, record)[1] == "measured" and len(calls) == 2 + n
    assert cached_timing(path, parse, measure, record)[1] == "cached" and len(calls) == 1 + BUSY_RETRIES


def test_a_quiet_timing_replaces_a_busy_one(tmp_path, cpu):
    path = tmp_path / "kind" / "t.json"
    measure, calls = timer(NOISY, QUIET)
    cached_timing(path, parse, measure, record)
    assert cached_timing(path, parse, measure, record) == ({"a": 1.0, "b": 2.0}, "measured")
    assert cached_timing(path, parse, measure, record)[1] == "cached" and len(calls) == 2
    assert json.loads(path.read_text())["busy"] is False


def test_a_steady_load_marks_even_a_steady_timing_busy(tmp_path, cpu):
    cpu["now"] = 4.0 * (os.cpu_count() or 1)
    path = tmp_path / "kind" / "t.json"
    cached_timing(path, parse, timer(QUIET)[0], record)
    assert json.loads(path.read_text())["busy"] is True


def test_what_cannot_be_timed_is_not_stored(tmp_path, cpu):
    path = tmp_path / "kind" / "t.json"
    assert cached_timing(path, parse, lambda: None, record) == (None, "unmeasured")
    assert not path.exists()
    cached_timing(path, parse, timer(NOISY)[0], record)  # a busy record...
    assert cached_timing(path, parse, lambda: {}, record) == ({"a": 0.5, "b": 2.0}, "cached")  # ...still serves
