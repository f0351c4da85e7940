"""The HTTP layer on a fake engine (fast): the OpenAI client round trip (chat and completions, streaming and
not), strategy selection, malformed input as 4xx error objects, the bounded queue (429 + Retry-After), bearer
auth, internal failures without tracebacks, client disconnects cancelling their sequence, and /metrics."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_process import client


def test_chat_and_completions_round_trip(fake_server):
    srv = fake_server()
    c = client(srv.url)
    r = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hello"}])
    assert r.choices[0].message.content == "echo: hello" and r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 11, 16)
    extra = r.model_extra["mtpflow"]
    assert extra["strategy"] == "pld" and extra["mal"] == 2.0 and extra["accepted_tokens"] == 5
    assert "trace_run_id" in extra

    chunks = list(c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hello"}],
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "echo: hello"
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    assert finish[0].model_extra["mtpflow"]["mal"] == 2.0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 11

    r = c.completions.create(model="fake", prompt="abcdef", max_tokens=4)
    assert r.choices[0].text == "echo" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    pieces = [ch.choices[0].text for ch in c.completions.create(model="fake", prompt="abcdef", stream=True)]
    assert "".join(pieces) == "echo: abcdef"
    r = c.completions.create(model="fake", prompt=[1, 2, 3])
    assert r.choices[0].text == "echo: BCD"
    r = c.completions.create(model="fake", prompt="abc def", stop=[" d"])
    assert r.choices[0].text == "echo: abc" and r.choices[0].finish_reason == "stop"


def test_strategy_from_body_or_model_id(fake_server):
    srv = fake_server()
    c = client(srv.url)
    ids = [m.id for m in c.models.list().data]
    assert ids == ["fake", "fake:baseline", "fake:pld"]
    msgs = [{"role": "user", "content": "x"}]
    r = c.chat.completions.create(model="fake", messages=msgs, extra_body={"mtpflow": {"strategy": "baseline"}})
    assert r.model_extra["mtpflow"]["strategy"] == "baseline"
    r = c.chat.completions.create(model="fake:baseline", messages=msgs)
    assert r.model_extra["mtpflow"]["strategy"] == "baseline" and r.model == "fake:baseline"
    r = c.chat.completions.create(model="fake:pld", messages=msgs,
                                  extra_body={"mtpflow": {"strategy": "pld", "overrides": {"k": 3}}})
    assert r.model_extra["mtpflow"]["strategy"] == "pld"
    with pytest.raises(openai.BadRequestError, match="names strategy 'baseline'"):
        c.chat.completions.create(model="fake:baseline", messages=msgs, extra_body={"mtpflow": {"strategy": "pld"}})
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="gpt-4o", messages=msgs)
    assert err.value.body["code"] == "model_not_found"
    assert c.models.retrieve("fake:pld").model_extra["mtpflow"] == {"strategy": "pld", "default": False}


MALFORMED = [
    # (endpoint, raw body or JSON value, status, param)
    ("chat", b"{not json", 400, None),
    ("chat", b"\xff\xfe", 400, None),
    ("chat", [1, 2], 400, None),
    ("chat", b"[" * 100000 + b"]" * 100000, 400, None),
    ("chat", {"model": "fake"}, 400, "messages"),
    ("chat", {"model": "fake", "messages": []}, 400, "messages"),
    ("chat", {"model": "fake", "messages": "hi"}, 400, "messages"),
    ("chat", {"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("chat", {"model": "fake", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat", {"model": "fake", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ("chat", {"model": "fake", "messages": [{"role": "user", "content": "   "}]}, 400, "messages"),
    ("chat", {"model": 7, "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}, 400, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400, "top_p"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2.5}, 400,
     "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, 400, "max_tokens"),
    # found by the fuzzer: max_tokens went unchecked beside max_completion_tokens
    ("completion", {"prompt": "0", "max_completion_tokens": 4, "max_tokens": True}, 400, "max_tokens"),
    ("completion", {"prompt": "0", "user": ["not", "a", "string"]}, 400, "user"),  # found by the fuzzer too
    ("completion", {"prompt": "0", "timeout": 0}, 400, "timeout"),
    ("completion", {"prompt": "0", "timeout": "soon"}, 400, "timeout"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stop": 5}, 400, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "seed": "x"}, 400, "seed"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "seed": 2 ** 70}, 400, "seed"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stream_options": 3}, 400, "stream_options"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "mtpflow": "pld"}, 400, "mtpflow"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "mtpflow": {"strategy": "warp"}}, 400,
     "mtpflow.strategy"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "mtpflow": {"stratgy": "pld"}}, 400,
     "mtpflow.stratgy"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "mtpflow": {"overrides": {"nope": 1}}}, 400, None),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "mtpflow": {"overrides": {"k": [1]}}}, 400,
     "mtpflow.overrides.k"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "mtpflow": {"top_k": -1}}, 400, "mtpflow.top_k"),
    ("chat", {"messages": [{"role": "user", "content": "x" * 500}]}, 400, None),  # over the fake's context
    ("completion", {"model": "fake"}, 400, "prompt"),
    ("completion", {"prompt": ""}, 400, "prompt"),
    ("completion", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completion", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completion", {"prompt": {"text": "a"}}, 400, "prompt"),
    ("completion", {"prompt": "a", "echo": True}, 400, "echo"),
    ("completion", {"prompt": "a", "best_of": 3}, 400, "best_of"),
    ("completion", {"prompt": "a", "model": "fake:warp"}, 404, "model"),
]


@pytest.fixture(scope="module")
def shared_server():
    from fake_engine import FakeEngine
    from server_process import InProcessServer

    from mtpflow.serve.app import create_app

    app = create_app(FakeEngine(), served_model="fake", default_strategy="pld")
    with InProcessServer(app) as srv:
        yield srv


@pytest.mark.parametrize("endpoint,body,status,param", MALFORMED)
def test_malformed_input_is_a_4xx_error_object(shared_server, endpoint, body, status, param):
    srv = shared_server
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(srv.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "Traceback" not in r.text
    assert "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param
    assert httpx.get(srv.url + "/health").status_code == 200  # still serving


def test_unknown_paths_and_methods_are_error_objects(fake_server):
    srv = fake_server()
    r = httpx.get(srv.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(srv.url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_queue_full_is_429_with_retry_after(fake_server):
    srv = fake_server(max_batch_size=1, max_waiting=1, step_seconds=0.2)
    body = {"model": "fake", "prompt": "a long enough prompt to keep the engine busy", "max_tokens": 10}
    with ThreadPoolExecutor(2) as pool:
        # one running, one waiting (a status line waits for the request's first token, so these block)
        held = [pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=60)]
        wait_for(lambda: srv.engine.num_running == 1)
        held.append(pool.submit(httpx.post, srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60))
        wait_for(lambda: srv.engine.num_waiting == 1)
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            client(srv.url).completions.create(model="fake", prompt="x" * 40, max_tokens=40)
        assert [f.result().status_code for f in held] == [200, 200]
    text = httpx.get(srv.url + "/metrics").text
    assert 'mtpflow_server_requests_total{endpoint="/v1/completions",outcome="queue_full"} 2.0' in text


def test_bearer_auth(fake_server, capfd):
    key = "sk-test-0123456789-secret"
    srv = fake_server(api_key=key)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as err:
        client(srv.url, api_key="wrong").chat.completions.create(model="fake", messages=msgs)
    assert err.value.body["code"] == "invalid_api_key"
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    assert client(srv.url, api_key=key).chat.completions.create(model="fake", messages=msgs).choices[0].message.content
    assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/metrics").status_code == 200
    out, errout = capfd.readouterr()
    assert key not in out + errout


def test_internal_failure_is_a_500_without_traceback(fake_server):
    srv = fake_server()
    c = client(srv.url)
    with pytest.raises(openai.InternalServerError) as err:
        c.completions.create(model="fake", prompt="please FAIL now")
    assert "Traceback" not in str(err.value.body) and err.value.body["type"] == "server_error"
    with pytest.raises(openai.APIError, match="decode failed"):
        for _ in c.completions.create(model="fake", prompt="please FAIL now", stream=True):
            pass
    assert c.completions.create(model="fake", prompt="fine").choices[0].text == "echo: fine"


def test_client_disconnect_cancels_only_its_sequence(fake_server):
    srv = fake_server(step_seconds=0.05, chars_per_step=1)
    body = {"model": "fake", "prompt": "a prompt long enough for many steps", "max_tokens": 60, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json=body) as leaver:
            lines = leaver.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        # the connection is closed here, mid-stream
        r = h.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("echo: a prompt")
    deadline = time.time() + 10
    while time.time() < deadline and not any(x.cancelled for x in srv.engine.finished):
        time.sleep(0.05)
    cancelled = [x for x in srv.engine.finished if x.cancelled]
    assert len(cancelled) == 1 and cancelled[0].status == "interrupted"
    assert [x.status for x in srv.engine.finished if not x.cancelled] == ["complete"]


def test_metrics_count_requests_and_latencies(fake_server):
    srv = fake_server()
    c = client(srv.url)
    for _ in range(3):
        c.completions.create(model="fake", prompt="abc")
    list(c.completions.create(model="fake", prompt="abc", stream=True))
    httpx.post(srv.url + "/v1/completions", json={"prompt": ""})
    text = httpx.get(srv.url + "/metrics").text
    assert 'mtpflow_server_requests_total{endpoint="/v1/completions",outcome="complete"} 4.0' in text
    assert 'mtpflow_server_requests_total{endpoint="/v1/completions",outcome="rejected"} 1.0' in text
    assert "mtpflow_server_requests_running 0.0" in text and "mtpflow_server_requests_waiting 0.0" in text
    assert 'mtpflow_server_time_to_first_token_seconds_count{strategy="pld"} 4.0' in text
    assert 'mtpflow_server_e2e_request_latency_seconds_count{strategy="pld"} 4.0' in text
    assert 'mtpflow_server_inter_token_latency_seconds_count{strategy="pld"} 32.0' in text  # 4 x (9 - 1)
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("mtpflow_server_batch_size_count"))
    assert count >= 5  # 9 characters at 2 per step: 5 steps per request
