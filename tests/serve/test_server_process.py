"""``python -m mtpflow.serve`` as a real process on 127.0.0.1 (a tiny random model saved to a folder), driven by
the official ``openai`` package: greedy answers identical to the CLI's and to HF greedy, 8 concurrent clients
x 4 requests all answered correctly, a client killed mid-stream leaves an ``interrupted`` run while the others
are served, malformed input is a 4xx error object (the process never dies), and the API key is required and
never written to the log or the traces. The SIGTERM and retention tests are in test_server_shutdown.py."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from server_process import REPO, ServerProcess, client, save_tiny_model

KEY = "sk-mtpflow-test-7c1e9d"
PROMPTS = ["the quick brown fox", "def add(a, b):", "Summarize the following text in one sentence.",
           "speculative decoding drafts tokens", "lazy dog jumps", "return a + b", "verify them in one forward",
           "fox and dog"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def server(tiny_folder, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    srv = ServerProcess(tmp / "server.log", f"model.name={tiny_folder}", f"trace.db={tmp / 'traces.db'}",
                        "trace.sample=1.0", "strategy=pld", env={"MTPFLOW_API_KEY": KEY})
    srv.db = tmp / "traces.db"
    srv.model = str(tiny_folder)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_folder):
    """HF greedy (``model.generate``) text for a prompt: ``reference(prompt, chat, n)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers import hf_greedy

    model = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    tok = AutoTokenizer.from_pretrained(tiny_folder)
    cache = {}

    def run(prompt: str, chat: bool, n: int) -> str:
        if (prompt, chat, n) not in cache:
            if chat:
                ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=True)
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            else:
                ids = tok(prompt, add_special_tokens=True)["input_ids"]
            cache[prompt, chat, n] = tok.decode(hf_greedy(model, list(ids), n), skip_special_tokens=True)
        return cache[prompt, chat, n]

    return run


def cli_text(model: str, prompt: str, *overrides: str) -> str:
    out = subprocess.run([sys.executable, "-m", "mtpflow", f"model.name={model}", f"prompt={prompt}", "output=json",
                          "trace=off", *overrides], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)["text"]


def test_chat_and_completions_identical_to_the_cli(server):
    c = client(server.url, KEY)
    model = c.models.list().data[0].id
    assert model == server.model
    prompt = PROMPTS[0]
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=20)
    assert chat.choices[0].message.content == cli_text(server.model, prompt, "strategy=pld", "max_new_tokens=20")
    assert chat.usage.completion_tokens == 20 and chat.choices[0].finish_reason == "length"
    figures = chat.model_extra["mtpflow"]
    assert figures["strategy"] == "pld" and figures["mal"] >= 1.0 and figures["accepted_tokens"] >= 0
    run = sqlite3.connect(server.db).execute("SELECT status, strategy FROM runs WHERE id = ?",
                                             (figures["trace_run_id"],)).fetchone()
    assert run == ("complete", "pld")

    streamed = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=20,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20
    # the same prompt again: its whole 16-token blocks came from the engine's prefix cache (at least one token ran)
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached <= chunks[-1].usage.prompt_tokens - 1 and cached % 16 == 0

    text = c.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20).choices[0].text
    assert text == cli_text(server.model, PROMPTS[1], "strategy=pld", "max_new_tokens=20", "chat=false")
    pieces = [ch.choices[0].text for ch in c.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20,
                                                                stream=True)]
    assert "".join(pieces) == text
    # another strategy by model id and by extra_body: lossless, so the same text
    for kwargs in ({"model": f"{model}:baseline"}, {"model": model, "extra_body": {"mtpflow": {"strategy": "jacobi"}}}):
        again = c.completions.create(prompt=PROMPTS[1], max_tokens=20, **kwargs)
        assert again.choices[0].text == text
    assert again.model_extra["mtpflow"]["strategy"] == "jacobi"


def test_eight_concurrent_clients_four_requests_each(server, reference):
    model = server.model
    results, errors = {}, []

    def worker(i: int):
        c = client(server.url, KEY)
        prompt = PROMPTS[i]
        try:
            for j in range(4):
                chat, stream = j in (0, 2), j in (1, 2)
                if chat:
                    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=12, stream=stream)
                    text = ("".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream
                            else r.choices[0].message.content)
                else:
                    r = c.completions.create(model=model, prompt=prompt, max_tokens=12, stream=stream)
                    text = "".join(ch.choices[0].text for ch in r) if stream else r.choices[0].text
                results[i, j] = (prompt, chat, text)
        except Exception as exc:  # collected: a thread's assertion would be lost
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors
    assert len(results) == 32  # none lost
    for (i, j), (prompt, chat, text) in sorted(results.items()):
        assert text == reference(prompt, chat, 12), (i, j)


def test_client_killed_mid_stream_is_interrupted_and_others_go_on(server, reference):
    marker = "killed client prompt"
    script = f"""
import openai, sys
c = openai.OpenAI(base_url={server.url + '/v1'!r}, api_key={KEY!r}, max_retries=0)
for chunk in c.completions.create(model={server.model!r}, prompt={marker!r}, max_tokens=900, stream=True):
    print("chunk", flush=True)
"""
    victim = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    for _ in range(3):
        assert victim.stdout.readline().startswith("chunk")
    victim.kill()
    victim.wait()
    c = client(server.url, KEY)
    text = c.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=12).choices[0].text
    assert text == reference(PROMPTS[2], False, 12)
    deadline = time.time() + 60
    while True:
        row = sqlite3.connect(server.db).execute(
            "SELECT status, stats FROM runs WHERE prompt = ? ORDER BY id DESC", (marker,)).fetchone()
        if row and row[0] != "running" or time.time() > deadline:
            break
        time.sleep(0.2)
    assert row[0] == "interrupted"
    assert json.loads(row[1])["new_tokens"] < 900
    assert server.alive


REAL_ENGINE_MALFORMED = [
    {"prompt": "x " * 3000},  # over the model's context
    {"prompt": [999999]},  # outside the vocabulary
    {"prompt": "a", "mtpflow": {"overrides": {"propose.no_such_setting": 1}}},
    {"prompt": "a", "mtpflow": {"overrides": {"_target_": "os.system"}}},
    {"prompt": "a", "mtpflow": {"overrides": {"k": 10000}}},
    {"prompt": "a", "mtpflow": {"strategy": "pld", "overrides": {"propose": 3}}},  # a section is not a value
    {"prompt": "a", "mtpflow": {"strategy": "no-such-strategy"}},
    {"prompt": "a", "temperature": float("nan")},
]


def test_malformed_input_gets_a_4xx_and_the_server_lives(server):
    from test_http_fake_engine import MALFORMED

    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    cases = [(e, b, s) for e, b, s, _ in MALFORMED if e != "chat" or not (isinstance(b, dict) and "x" * 500 in
                                                                           str(b))]
    cases += [("completion", b, 400) for b in REAL_ENGINE_MALFORMED]
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as h:
        for endpoint, body, status in cases:
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            if isinstance(body, dict) and body.get("model", "fake") == "fake":
                body = {**body, "model": server.model}
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = h.post(path, content=raw)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["message"] and "Traceback" not in r.text and "\n" not in err["message"], r.text
        assert h.get("/health").status_code == 200
        assert server.alive
        r = h.post("/v1/completions", json={"model": server.model, "prompt": "still fine", "max_tokens": 4})
        assert r.status_code == 200
    assert "Traceback" not in server.log()


def test_api_key_required_and_never_logged(server):
    with pytest.raises(openai.AuthenticationError):
        client(server.url, "wrong-key").completions.create(model=server.model, prompt="a", max_tokens=2)
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "a"}).status_code == 401
    assert client(server.url, KEY).completions.create(model=server.model, prompt="a", max_tokens=2).choices
    metrics = httpx.get(server.url + "/metrics").text
    assert 'outcome="unauthorized"' in metrics
    assert KEY not in server.log()
    assert KEY.encode() not in server.db.read_bytes()
    wal = server.db.with_name(server.db.name + "-wal")
    assert not wal.exists() or KEY.encode() not in wal.read_bytes()
