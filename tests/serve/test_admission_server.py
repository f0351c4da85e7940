"""Overload and deadlines through ``python -m mtpflow.serve`` (a real process on 127.0.0.1, the tiny model) and
the official ``openai`` client: with ``engine.max_waiting=4`` and 32 clients at once every request is answered
(200) or refused at once (429 with ``Retry-After`` and an error object, within 1 s), none times out at the
client and ``/metrics`` counts both; a request waiting past ``engine.max_wait_seconds`` is a 429 too, streamed
or not; a request's ``timeout`` ends it with a 408 (or an error event once streaming) and frees its slot; a
``max_tokens`` that cannot fit the context is a 400, as OpenAI answers it."""
from __future__ import annotations

import sqlite3
import time

import openai
import pytest

from mtpflow.tools.overload import measure, requests_total
from server_process import ServerProcess, client, save_tiny_model

CLIENTS = 32


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_32_clients_against_max_waiting_4_are_answered_or_refused_at_once(tiny_folder):
    """``python -m mtpflow.tools.overload`` (docs/bench/overload_dec05.md measures it on the default model)."""
    report = measure([f"model={tiny_folder}", "clients=32", "max_waiting=4", "max_tokens=200",
                      "overrides=[strategy=pld,max_batch_size=4]", "client_timeout=120"])
    assert report["other"] == []  # no client timeout, no status but 200 and 429
    assert report["answered"] >= 4 and report["refused"] >= 1 and report["answered"] + report["refused"] == CLIENTS
    assert report["refused_after_s"]["max"] < 1.0
    assert report["refused_with_retry_after_and_error_object"] == report["refused"]
    assert report["refusal_codes"] == ["queue_full"] and report["retry_after"] == ["1"]
    assert report["metrics_counted"].get("complete") == report["answered"]
    assert report["metrics_counted"].get("queue_full") == report["refused"]
    assert report["must_hold"]


@pytest.fixture(scope="module")
def one_slot(tiny_folder, tmp_path_factory):
    """One running request at a time; waiting more than 0.5 s for the slot is refused."""
    tmp = tmp_path_factory.mktemp("one-slot")
    with ServerProcess(tmp / "server.log", f"model.name={tiny_folder}", f"trace.db={tmp / 'traces.db'}",
                       "strategy=pld", "max_batch_size=1", "engine.max_wait_seconds=0.5") as server:
        server.db = tmp / "traces.db"
        server.model = client(server.url).models.list().data[0].id
        yield server
        assert server.stop() == 0


def test_max_tokens_past_the_context_is_a_400(one_slot):
    c = client(one_slot.url)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=one_slot.model, prompt="hello", max_tokens=10 ** 9)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "max_tokens"
    assert "new tokens fit, 1000000000 were asked for" in err.value.body["message"]
    # without max_tokens the server's default applies, bounded by the context as before
    assert c.completions.create(model=one_slot.model, prompt="hello").choices[0].text


def test_a_request_waiting_past_max_wait_seconds_gets_429(one_slot):
    c = client(one_slot.url)
    for stream in (True, False):
        # one token per step (baseline, not the server's pld, which drafts the tiny model's repetitive answer
        # and ends 1000 tokens in well under the 0.5 s bound on a quiet machine), a fresh one per case
        busy = c.completions.create(model=one_slot.model, prompt="keep the slot busy", max_tokens=1000, stream=True,
                                    extra_body={"mtpflow": {"strategy": "baseline"}})
        next(iter(busy))  # the slot is taken
        t0 = time.perf_counter()
        with pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model=one_slot.model, prompt="no room", max_tokens=4, stream=stream)
        assert 0.4 < time.perf_counter() - t0 < 5.0
        assert err.value.body["code"] == "queue_timeout" and err.value.response.headers["retry-after"] == "1"
        busy.close()
    assert requests_total(one_slot.url).get("queue_timeout") == 2


def test_a_timeout_ends_the_request_and_frees_its_slot(one_slot):
    c = client(one_slot.url)
    t0 = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as err:
        c.completions.create(model=one_slot.model, prompt="a long answer", max_tokens=900,
                             extra_body={"timeout": 0.2, "mtpflow": {"strategy": "baseline"}})
    assert err.value.status_code == 408 and err.value.body["code"] == "request_timeout"
    assert err.value.body["param"] == "timeout" and "ran past its deadline of 0.2 s" in err.value.body["message"]
    assert err.value.response.headers["x-should-retry"] == "false"
    assert time.perf_counter() - t0 < 5.0
    with pytest.raises(openai.APIError, match="ran past its deadline"):  # streaming: an error event
        for _ in c.completions.create(model=one_slot.model, prompt="a long answer", max_tokens=900, stream=True,
                                      extra_body={"timeout": 0.2, "mtpflow": {"strategy": "baseline"}}):
            pass
    # the slot is free again: a plain request is answered at once
    assert c.completions.create(model=one_slot.model, prompt="next", max_tokens=4).choices[0].text
    with pytest.raises(openai.BadRequestError, match="timeout must be in"):
        c.completions.create(model=one_slot.model, prompt="x", extra_body={"timeout": -1})
    assert requests_total(one_slot.url).get("timeout") == 2
    deadline = time.time() + 30
    while True:  # the trace recorder writes the ended runs within its flush interval
        rows = sqlite3.connect(one_slot.db).execute(
            "SELECT status FROM runs WHERE prompt = 'a long answer'").fetchall()
        if len(rows) == 2 and all(r[0] != "running" for r in rows) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert rows == [("failed",), ("failed",)]
