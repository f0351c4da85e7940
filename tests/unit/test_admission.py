"""Admission control and deadlines in the engine: ``engine.max_waiting`` (and its old spelling ``max_waiting``)
bounds the queue and a full queue refuses before any tokenizing; ``engine.max_wait_seconds`` refuses a request
that waited too long for a slot; a request's ``timeout`` (or ``engine.request_timeout``) ends it, running or
waiting, and frees its slot for the next; ``refuse_past_context`` turns a ``max_new_tokens`` that cannot fit the
context into one error line instead of a silently shorter answer."""
from __future__ import annotations

import threading
import time

import pytest

from helpers import hf_greedy
from mtpflow.config import compose
from mtpflow.engine import Admission, DeadlineExceeded, Engine, QueueFull, QueueTimeout
from mtpflow.errors import ConfigError, UserError
from mtpflow.request import ContextLengthExceeded, Request

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 9]


def make_engine(loaded, *overrides):
    return Engine(compose(["strategy=pld", "trace=off", "max_new_tokens=16", "batch_k=off", *overrides]),
                  loaded=loaded)


class Hold:
    """An ``on_step`` that keeps the engine's one slot busy until released."""

    def __init__(self):
        self.running, self.release = threading.Event(), threading.Event()

    def __call__(self, record, tokens):
        self.running.set()
        self.release.wait(60)


@pytest.mark.parametrize("overrides,expected", [
    ([], Admission(64, None, None)),
    (["engine.max_waiting=3", "engine.max_wait_seconds=2.5", "engine.request_timeout=30"], Admission(3, 2.5, 30.0)),
    (["max_waiting=5"], Admission(5, None, None)),  # the old spelling still works
    (["max_waiting=5", "engine.max_waiting=5"], Admission(5, None, None)),
])
def test_admission_settings(overrides, expected):
    assert Admission.from_config(compose(overrides)) == expected


@pytest.mark.parametrize("overrides,message", [
    (["max_waiting=5", "engine.max_waiting=7"], "disagree"),
    (["engine.max_waiting=-1"], "engine.max_waiting must be a whole number >= 0"),
    (["engine.max_wait_seconds=0"], "engine.max_wait_seconds must be in (0"),
    (["engine.request_timeout=inf"], "engine.request_timeout must be a finite number"),
    (["engine.request_timeout=soon"], "engine.request_timeout must be a number"),
])
def test_bad_admission_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Admission.from_config(compose(overrides))


def test_a_full_queue_refuses_before_tokenizing(tiny, monkeypatch):
    engine = make_engine(tiny, "max_batch_size=1", "engine.max_waiting=1")
    hold = Hold()
    first = engine.submit(Request(prompt_ids=PROMPT), on_step=hold)
    assert hold.running.wait(60)
    second = engine.submit(Request(prompt_ids=PROMPT))
    prepared = []
    real = engine.prepare
    monkeypatch.setattr(engine, "prepare", lambda *a, **k: prepared.append(1) or real(*a, **k))
    t0 = time.perf_counter()
    with pytest.raises(QueueFull, match=r"1 requests running and 1 waiting \(engine.max_waiting is 1\)"):
        engine.submit(Request(prompt="never tokenized"))
    assert time.perf_counter() - t0 < 1.0 and prepared == []
    hold.release.set()
    for handle in (first, second):
        assert handle.result(60).token_ids == hf_greedy(tiny.model, PROMPT, 16)


def test_a_request_waiting_past_max_wait_seconds_is_refused(tiny):
    engine = make_engine(tiny, "max_batch_size=1", "engine.max_wait_seconds=0.3")
    hold = Hold()
    first = engine.submit(Request(prompt_ids=PROMPT), on_step=hold)
    assert hold.running.wait(60)
    waiting = engine.submit(Request(prompt_ids=PROMPT))
    time.sleep(0.5)
    hold.release.set()  # the engine's next loop finds it past its bound
    with pytest.raises(QueueTimeout, match=r"waited 0\.\d s for a free slot, over engine.max_wait_seconds \(0.3 s\)"):
        waiting.result(60)
    assert waiting.status == "failed" and isinstance(QueueTimeout("x"), QueueFull)
    assert first.result(60).token_ids == hf_greedy(tiny.model, PROMPT, 16)


def test_a_deadline_ends_a_running_request_and_frees_its_slot(tiny):
    engine = make_engine(tiny, "max_batch_size=1")
    slow = engine.submit(Request(prompt_ids=PROMPT, max_new_tokens=500, timeout=0.3),
                         on_step=lambda record, tokens: time.sleep(0.02))
    after = engine.submit(Request(prompt_ids=PROMPT))  # waits for the one slot
    with pytest.raises(DeadlineExceeded, match=r"ran past its deadline of 0.3 s \(timeout\) and was stopped after "
                                               r"\d+ tokens"):
        slow.result(60)
    assert slow.status == "failed" and 0 < len(slow._tokens) < 500
    assert after.result(60).token_ids == hf_greedy(tiny.model, PROMPT, 16)
    assert engine.num_running == 0 and engine.num_waiting == 0


def test_the_engine_default_deadline_and_a_deadline_in_the_queue(tiny):
    engine = make_engine(tiny, "max_batch_size=1", "engine.request_timeout=0.4")
    hold = Hold()
    first = engine.submit(Request(prompt_ids=PROMPT, timeout=60), on_step=hold)  # its own timeout wins
    assert hold.running.wait(60)
    queued = engine.submit(Request(prompt_ids=PROMPT))
    time.sleep(0.6)
    hold.release.set()
    with pytest.raises(DeadlineExceeded, match="was stopped in the queue"):
        queued.result(60)
    assert first.result(60).token_ids == hf_greedy(tiny.model, PROMPT, 16)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "soon"])
def test_a_bad_timeout_is_one_line(tiny, timeout):
    with pytest.raises(UserError, match="timeout must be"):
        make_engine(tiny).check(Request(prompt_ids=PROMPT, timeout=timeout))


def test_max_new_tokens_past_the_context_is_refused_when_asked(tiny):
    engine = make_engine(tiny)
    room = tiny.max_context - len(PROMPT)
    assert engine.check(Request(prompt_ids=PROMPT, max_new_tokens=room, refuse_past_context=True)) == len(PROMPT)
    with pytest.raises(ContextLengthExceeded, match=f"at most {room} new tokens fit, {room + 1} were asked for"):
        engine.check(Request(prompt_ids=PROMPT, max_new_tokens=room + 1, refuse_past_context=True))
    # without the flag the request decodes until the context is full (the CLI, the Python API)
    engine.check(Request(prompt_ids=PROMPT, max_new_tokens=10 ** 9))
    # a strategy with a KV window runs past the context: nothing to refuse
    engine.check(Request(prompt_ids=PROMPT, strategy="composite_gate", max_new_tokens=10 ** 9,
                         refuse_past_context=True))
