"""The running ``python -m mtpflow.playground`` (default model) through ``gradio_client``: a comparison, user
mistakes answered in the page while the app keeps serving, four users at once, history and /metrics."""
from __future__ import annotations

import threading
import urllib.request

import pytest

pytestmark = pytest.mark.default_model

PROMPT = "Summarize in one sentence: the meeting moved from Tuesday to Thursday at 3 pm because the client asked."
OUTPUTS = ["status", "pane_a", "pane_b", "stats_a", "stats_b", "speedup", "plot", "steps_a", "steps_b", "summary"]


def compare(client, prompt=PROMPT, a="pld", b="baseline", max_new_tokens=16, temperature="", k="", params_a="",
            params_b=""):
    out = client.predict(prompt, a, b, max_new_tokens, temperature, k, params_a, params_b, True,
                         api_name="/compare")
    return dict(zip(OUTPUTS, out))


@pytest.fixture(scope="module")
def client(playground_url):
    from gradio_client import Client

    return Client(playground_url, verbose=False)


def test_compare_through_the_api(client):
    out = compare(client)
    summary = out["summary"]
    assert summary["error"] is False, summary["status"]
    a, b = summary["a"], summary["b"]
    assert a["strategy"] == "pld" and b["strategy"] == "baseline"
    assert a["text"].strip() and a["text"] == b["text"]  # both lossless and greedy: the same answer
    assert a["stats"]["new_tokens"] == b["stats"]["new_tokens"] <= 16
    assert b["stats"]["mal"] == 1.0 and a["stats"]["forward_passes"] <= b["stats"]["forward_passes"]
    assert summary["speedup"] == pytest.approx(a["stats"]["tokens_per_second"] / b["stats"]["tokens_per_second"],
                                               rel=1e-3)
    assert a["run_id"] and b["run_id"] and a["run_id"] != b["run_id"]
    assert "tok tok-" in out["pane_a"] and "tok tok-" in out["pane_b"]
    assert "MAL" in out["stats_a"] and "tokens/s" in out["stats_b"]
    assert "Speedup of A (pld) over B (baseline)" in out["speedup"]


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "   "}, "empty prompt"),
    ({"max_new_tokens": 0}, "max new tokens"),
    ({"k": "-2"}, "K must"),
    ({"temperature": "warm"}, "temperature"),
    ({"params_a": "strategy.propose._target_=os.system"}, "not allowed"),
    ({"params_b": "strategy.propose.max_ngram=-3"}, "strategy B"),
])
def test_mistakes_get_a_message_and_the_app_keeps_serving(client, kwargs, message):
    out = compare(client, **kwargs)
    assert out["summary"]["error"] is True
    assert message in out["summary"]["status"] and 'data-error="true"' in out["status"]
    assert out["summary"]["a"] is None  # nothing ran


def test_still_serving_after_mistakes(client):
    out = compare(client, max_new_tokens=4, a="baseline")
    assert out["summary"]["error"] is False and out["summary"]["a"]["text"].strip()


def test_four_users_at_once_get_their_answers(playground_url):
    from gradio_client import Client

    prompts = ["Name three colors.", "What is 2 + 2?", "Say hello in French.", "Name a planet."]
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def user(i):
        try:
            results[i] = compare(Client(playground_url, verbose=False), prompt=prompts[i], max_new_tokens=8)["summary"]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3]
    for summary in results.values():
        assert summary["error"] is False, summary["status"]
        assert summary["a"]["text"].strip() and summary["a"]["text"] == summary["b"]["text"]


def test_a_and_b_decode_together(playground, client):
    """A and B of one comparison are requests of the one engine and decode in the same batch: their recorded
    runs overlap in time (before the engine, the app ran A, then B, behind a lock)."""
    from mtpflow.traces import TraceStore

    summary = compare(client, max_new_tokens=24)["summary"]
    assert summary["error"] is False, summary["status"]
    runs = {r["id"]: r for r in TraceStore(playground.db).list_runs(limit=200)}
    a, b = runs[int(summary["a"]["run_id"])], runs[int(summary["b"]["run_id"])]
    assert a["finished_at"] is not None and b["finished_at"] is not None
    assert a["started_at"] < b["finished_at"] and b["started_at"] < a["finished_at"]


def test_history_through_the_api(client):
    runs = client.predict(api_name="/history_runs")
    ids = [row[0] for row in runs["data"]]
    assert len(ids) >= 2
    opened = client.predict(str(ids[0]), str(ids[1]), api_name="/history_open")
    assert 'data-error="true"' not in opened[0]
    assert "tok tok-" in opened[1] and "tok tok-" in opened[2]
    assert "MAL" in opened[3]
    missing = client.predict("999999", "", api_name="/history_open")
    assert 'data-error="true"' in missing[0] and "no run 999999" in missing[0]


def test_metrics_endpoint(playground_url):
    with urllib.request.urlopen(playground_url + "metrics", timeout=30) as r:
        body = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/plain")
    assert "mtpflow_spec_decode" in body
