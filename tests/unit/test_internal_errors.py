"""Internal errors keep their cause: a stage's bug (anything not a ``UserError``) fails its own request alone,
with one line naming the stage and the exception type; the full traceback goes to the ``mtpflow`` logger at
ERROR and into the run's row of the trace DB; ``MTPFLOW_DEBUG=1`` hands the caller the original exception."""
from __future__ import annotations

import logging
import sqlite3

import pytest

from helpers import hf_greedy
from mtpflow.engine import Engine
from mtpflow.errors import UserError
from mtpflow.plugins import hookimpl
from mtpflow.request import Request
from mtpflow.traces.store import SCHEMA_VERSION, TraceStore

NEW = 16
PROMPTS = [[5, 17, 23, 8, 42, 11, 9], [3, 3, 7, 19, 2, 3, 3, 7], [40, 41, 42, 43, 40, 41, 42, 43, 40]]  # 7, 8, 9


class DividesByZeroInPropose:
    """A stage with a bug: its proposer divides by zero on the third step."""

    @hookimpl(tryfirst=True)
    def propose(self, state, k):
        if state.step >= 2:
            return 1 / 0
        return None


class FailsIn:
    """Raises ``error`` from ``hook`` (gate, on_step_end or on_run_start) on the second step."""

    def __init__(self, hook: str, error: BaseException):
        self.hook, self.error = hook, error

    def _maybe(self, step):
        if step >= 1:
            raise self.error

    @hookimpl(tryfirst=True)
    def gate(self, state, draft, verification):
        if self.hook == "gate":
            self._maybe(state.step)

    @hookimpl
    def on_step_end(self, record):
        if self.hook == "on_step_end":
            self._maybe(record.step)

    @hookimpl
    def on_run_start(self, context):
        if self.hook == "on_run_start":
            raise self.error


@pytest.fixture
def engine(tiny, tmp_path):
    engine = Engine.from_overrides(["strategy=pld", f"trace.db={tmp_path / 'traces.db'}", f"max_new_tokens={NEW}",
                                    "batch_k=off", "strategy.propose.costs=null"], loaded=tiny)
    yield engine
    engine.close()


def failing_batch(engine, plugin) -> tuple[pytest.ExceptionInfo, list]:
    """Submit PROMPTS together, the first with ``plugin``; return its error and the others' handles."""
    handles = engine.submit_many([Request(prompt_ids=p) for p in PROMPTS[1:]])
    failing = engine.submit(Request(prompt_ids=PROMPTS[0]), extra_plugins=(plugin,))
    with pytest.raises(UserError) as info:
        failing.result(timeout=120)
    assert failing.status == "failed"
    return info, handles


def test_an_internal_error_is_one_line_a_logged_traceback_and_a_trace_row(engine, tiny, caplog):
    caplog.set_level(logging.ERROR, logger="mtpflow")
    info, others = failing_batch(engine, DividesByZeroInPropose())
    line = str(info.value)
    assert line == ("decoding failed in stage propose (DividesByZeroInPropose, strategy pld): "
                    "ZeroDivisionError: division by zero")
    assert isinstance(info.value.__cause__, ZeroDivisionError)  # the cause stays reachable
    # the other requests of the batch finish as HF greedy
    for prompt, handle in zip(PROMPTS[1:], others):
        assert handle.result().token_ids == hf_greedy(tiny.model, prompt, NEW)
    # the log: one ERROR record naming the request's line, with the traceback
    (record,) = [r for r in caplog.records if r.name == "mtpflow" and r.levelno == logging.ERROR]
    assert line in record.getMessage() and record.exc_info[0] is ZeroDivisionError
    logged = caplog.text
    assert "Traceback (most recent call last)" in logged and "return 1 / 0" in logged
    # the trace DB: the run failed, with its traceback in its row and its one line in its stats
    store = TraceStore(engine.cfg.trace.db)
    runs = {r["prompt_tokens"]: r for r in store.list_runs()}
    failed = runs[len(PROMPTS[0])]
    assert failed["status"] == "failed" and failed["stats"]["error"] == line
    assert "error_traceback" not in failed["stats"]
    assert failed["error_traceback"].startswith("Traceback (most recent call last)")
    assert "return 1 / 0" in failed["error_traceback"]
    assert "ZeroDivisionError: division by zero" in failed["error_traceback"]
    assert len(runs) == 3
    assert all(runs[len(p)]["status"] == "complete" and runs[len(p)]["error_traceback"] is None for p in PROMPTS[1:])


def test_mtpflow_debug_reraises_the_original_exception(engine, tiny, monkeypatch):
    monkeypatch.setenv("MTPFLOW_DEBUG", "1")
    handle = engine.submit(Request(prompt_ids=PROMPTS[0]), extra_plugins=(DividesByZeroInPropose(),))
    with pytest.raises(ZeroDivisionError):
        handle.result(timeout=120)
    with pytest.raises(ZeroDivisionError):
        engine.submit(Request(prompt_ids=PROMPTS[0]), extra_plugins=(DividesByZeroInPropose(),)).result(timeout=120)
    # without it (or with 0), the one line again
    monkeypatch.setenv("MTPFLOW_DEBUG", "0")
    with pytest.raises(UserError, match="ZeroDivisionError"):
        engine.submit(Request(prompt_ids=PROMPTS[0]), extra_plugins=(DividesByZeroInPropose(),)).result(timeout=120)


def test_generate_with_mtpflow_debug_raises_the_original(tiny, monkeypatch):
    from mtpflow.config import compose

    monkeypatch.setenv("MTPFLOW_DEBUG", "1")
    engine = Engine(compose(["strategy=pld", "trace=off", "max_new_tokens=8", "strategy.propose.costs=null"]),
                    loaded=tiny)

    class Broken:
        @hookimpl
        def on_step_end(self, record):
            raise KeyError("no such thing")

    try:
        real = engine.submit_many

        def with_broken(requests, **kwargs):
            return real(requests, extra_plugins=(Broken(),), **kwargs)

        monkeypatch.setattr(engine, "submit_many", with_broken)
        with pytest.raises(KeyError, match="no such thing"):
            engine.generate(Request(prompt_ids=PROMPTS[1]))
    finally:
        engine.close()


@pytest.mark.parametrize("hook, stage", [("gate", "gate"), ("on_step_end", "on_step_end"),
                                         ("on_run_start", "on_run_start")])
def test_the_line_names_the_stage(engine, hook, stage):
    info, others = failing_batch(engine, FailsIn(hook, IndexError("index 9 is out of bounds")))
    assert str(info.value) == (f"decoding failed in stage {stage} (FailsIn, strategy pld): "
                               "IndexError: index 9 is out of bounds")
    assert all(h.result().stats["new_tokens"] == NEW for h in others)


def test_a_bug_in_the_loop_between_stages_names_its_part_of_the_step(engine):
    class NotADraft:
        @hookimpl(tryfirst=True)
        def propose(self, state, k):
            return [1, 2, 3]

    info, _ = failing_batch(engine, NotADraft())
    assert str(info.value) == ("decoding failed in stage plan (strategy pld): "
                               "TypeError: propose returned list, not a Draft")


def test_a_failed_shared_verify_forward_says_verify(engine, tiny, monkeypatch, caplog):
    real = engine.backend.verify

    def verify(targets, *args, **kwargs):
        if len(targets) > 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")
        return real(targets, *args, **kwargs)

    monkeypatch.setattr(engine.backend, "verify", verify)
    handles = engine.submit_many([Request(prompt_ids=p) for p in PROMPTS[:2]])
    for handle in handles:
        with pytest.raises(UserError) as info:
            handle.result(timeout=120)
        assert str(info.value) == ("decoding failed in stage verify (strategy pld): "
                                   "RuntimeError: CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(engine.backend, "verify", real)
    assert engine.generate(Request(prompt_ids=PROMPTS[2])).token_ids == hf_greedy(tiny.model, PROMPTS[2], NEW)


def test_the_stage_timer_forgets_nothing_it_should_not():
    """Failures inside a stage are attributed to the innermost stage; exceptions the timer never saw are not
    attributed; the report reaches ``on_run_end`` through the result's stats."""
    from mtpflow.loop import StageTimer
    from mtpflow.types import DecodeResult

    timer = StageTimer()
    gen = timer._timed("gate")
    next(gen)
    boom = ValueError("x")
    with pytest.raises(ValueError):
        gen.throw(boom)
    assert timer.stage_of(boom) == ("gate", None) and timer.stage_of(ValueError("y")) is None
    assert timer.running is None and "gate" not in timer.seconds
    timer.report = {"error": "line", "error_traceback": "tb"}
    result = DecodeResult(text="", token_ids=[], stats={})
    wrapper = timer.on_run_end(result)
    next(wrapper)
    assert result.stats == {"error": "line", "error_traceback": "tb"}


def test_older_trace_files_get_the_traceback_column(tmp_path):
    """A trace DB written before runs had ``error_traceback`` gets the column when opened (no version bump, so
    an older mtpflow still reads the file), keeps its rows, and records tracebacks from then on."""
    path = tmp_path / "old.db"
    store = TraceStore(path)
    run = store.start_run(strategy="pld", config={}, model_id="m", prompt="p", prompt_tokens=2, package_version="0")
    store.finish_run(run, "complete", output_text="out", stats={"mal": 1.0})
    store.close()
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE runs DROP COLUMN error_traceback")
    con.commit()
    assert "error_traceback" not in {row[1] for row in con.execute("PRAGMA table_info(runs)")}
    con.close()

    store = TraceStore(path)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.get_run(run)["output_text"] == "out" and store.get_run(run)["error_traceback"] is None
    failed = store.start_run(strategy="pld", config={}, model_id="m", prompt="p", prompt_tokens=2,
                             package_version="0")
    store.finish_run(failed, "failed", output_text="", stats={"error": "line"}, error_traceback="Traceback ...")
    assert store.get_run(failed)["error_traceback"] == "Traceback ..."
    assert [r["id"] for r in store.list_runs()] == [failed, run]
    TraceStore(path)  # reopening a file that has the column changes nothing


def test_errors_helpers():
    from mtpflow.errors import PluginError, describe, internal_cause

    assert describe(ValueError("first\nsecond")) == "ValueError: first"
    assert describe(ValueError()) == "ValueError"
    assert len(describe(ValueError("x" * 1000))) < 320
    bug = ZeroDivisionError("division by zero")
    wrapped = PluginError("plugin p: hook propose raised ZeroDivisionError: division by zero")
    wrapped.__cause__ = bug
    assert internal_cause(bug) is bug and internal_cause(wrapped) is bug
    assert internal_cause(UserError("bad value")) is None and internal_cause(KeyboardInterrupt()) is None
    assert internal_cause(None) is None
