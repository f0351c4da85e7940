"""The peers in the same bench run (``peers=[vllm,llamacpp]``), without vLLM or llama.cpp installed:

- a fake peer python (a script standing in for the interpreter, printing canned protocol lines) checks the
  protocol end to end: the job mtpflow sends (the same prompt token ids, threads, model, GGUF), the rows that
  come back (batch 1 per class, the speculative mode, batch 16), the manifest's record, a run that fails;
- the worker half of ``mtpflow/tools/peers.py`` runs in a subprocess against small fake ``vllm`` and
  ``llama_cpp`` modules that follow those libraries' APIs (greedy tokens from a rule over each sequence's own
  tokens), so its scheduling (batch 16 through llama.cpp's low-level calls) is exercised;
- a peer whose python is not set, not executable or cannot import its engine stops the run: one line naming
  the peer and the variable, exit 2, nothing written.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from helpers import make_tiny_tokenizer, save_tiny_model
from mtpflow.tools import bench, peers

FAKE_PYTHON = textwrap.dedent("""\
    #!{python}
    # stands in for a peer's interpreter: answers mtpflow's protocol with canned lines
    import json, os, sys
    MARK = "MTPFLOW-PEER "
    args = sys.argv[1:]
    if "--check" in args:
        if os.environ.get("FAKE_PEER_BROKEN"):
            print("Traceback (most recent call last):", file=sys.stderr)
            print("ModuleNotFoundError: No module named '" + os.environ["FAKE_PEER_BROKEN"] + "'", file=sys.stderr)
            sys.exit(1)
        print(MARK + json.dumps({{"event": "ready", "peer": args[-1], "version": "9.9-fake"}}))
        sys.exit(0)
    job = json.loads(sys.stdin.read())
    with open(os.environ["FAKE_PEER_JOBS"], "a") as f:
        f.write(json.dumps(job) + "\\n")
    n = len(job["prompts"])
    print("INFO engine log noise, not protocol")
    print(MARK + json.dumps({{"event": "ready", "peer": job["peer"], "version": "9.9-fake"}}))
    if job["batch"] > 1 and os.environ.get("FAKE_PEER_FAIL_BATCH"):
        print("RuntimeError: out of KV cache", file=sys.stderr)
        print(MARK + json.dumps({{"event": "error", "message": "RuntimeError: out of KV cache"}}))
        sys.exit(1)
    for i in range(n):
        print(MARK + json.dumps({{"event": "progress", "done": i + 1, "total": n}}))
    ids = [[5, 6, 7, 8]] * n
    one = job["batch"] == 1
    print(MARK + json.dumps({{"event": "result", "token_ids": ids, "seconds": [0.01] * n if one else None,
                             "steps": [2] * n if one else None, "total_seconds": 0.02, "total_steps": 2 * n,
                             "acceptance": None, "config": {{"fake": True}}, "load_seconds": 0.0}}))
""")


def fake_python(folder: Path, name: str = "python") -> Path:
    path = folder / name
    path.write_text(FAKE_PYTHON.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=2)


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    python = fake_python(tmp_path)
    jobs = tmp_path / "jobs.jsonl"
    monkeypatch.setenv("MTPFLOW_VLLM_PYTHON", str(python))
    monkeypatch.setenv("MTPFLOW_LLAMACPP_PYTHON", str(python))
    monkeypatch.setenv("FAKE_PEER_JOBS", str(jobs))
    monkeypatch.delenv("FAKE_PEER_BROKEN", raising=False)
    monkeypatch.delenv("FAKE_PEER_FAIL_BATCH", raising=False)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake")
    return {"python": python, "jobs": jobs, "gguf": gguf}


def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "class": "one", "prompt": "the quick brown fox the quick brown fox"},
        {"id": "b", "class": "two", "prompt": "def add(a, b): return a + b"}]))
    return path


def test_peer_rows_in_the_same_table(tiny_dir, tmp_path, fakes, capsys):
    out = tmp_path / "out"
    code = bench.main([f"model={tiny_dir}", f"prompts={prompts_file(tmp_path)}", "strategies=[baseline]",
                       "max_new_tokens=8", "overrides=[trace=off,chat=false]", "peers=[vllm,llamacpp]",
                       f"peer_gguf={fakes['gguf']}", f"out={out}"])
    assert code == 0, capsys.readouterr().err[-2000:]
    summary = pd.read_csv(out / "bench_summary.csv")
    labels = ["vllm", "vllm n-gram", "llamacpp", "llamacpp prompt lookup"]
    for label in labels:  # batch 1: per class and overall, against HF in the same run
        part = summary[summary["strategy"] == label].set_index("class")
        assert list(part.index) == ["one", "two", "overall"]
        assert (part["speedup_vs_hf"] > 0).all() and part.loc["overall", "identical"] == "0/2"
        assert part.loc["overall", "mal"] == pytest.approx((8 - 2) / (4 - 2))  # steps 2 per prompt, 4 tokens
    for label in ("vllm, batch 16", "llamacpp, batch 16"):  # throughput, every prompt, at most 16 at once
        part = summary[summary["strategy"] == label]
        assert list(part["class"]) == ["overall"] and part["speedup_vs_hf"].isna().all()
        assert part["tokens_per_s"].iloc[0] == pytest.approx(8 / 0.02) and part["identical"].iloc[0] == "0/2"
    runs = pd.read_csv(out / "bench_runs.csv")
    assert set(runs["strategy"]) == {"hf_generate", "baseline", *labels}
    # the protocol: every run got mtpflow's own prompt token ids, its thread count, the model and the GGUF
    jobs = [json.loads(line) for line in fakes["jobs"].read_text().splitlines()]
    assert [(j["peer"], j["batch"], j["spec"]) for j in jobs] == [
        ("vllm", 1, "none"), ("vllm", 1, "ngram"), ("vllm", 16, "none"),
        ("llamacpp", 1, "none"), ("llamacpp", 1, "prompt_lookup"), ("llamacpp", 16, "none")]
    tok = make_tiny_tokenizer()
    from mtpflow.request import encode_prompt

    expected = [encode_prompt(tok, p, chat=False) for p in ("the quick brown fox the quick brown fox",
                                                           "def add(a, b): return a + b")]
    import torch

    for job in jobs:
        assert job["protocol"] == peers.PROTOCOL and job["prompts"] == expected and job["max_tokens"] == 8
        assert job["threads"] == torch.get_num_threads() and job["stop_ids"] == [0]
        assert job["model"] == str(tiny_dir) and job["gguf"] == str(fakes["gguf"].resolve())
    record = json.loads((out / "manifest.json").read_text())
    assert record["peers"]["vllm"]["version"] == "9.9-fake"
    assert record["peers"]["llamacpp"]["variable"] == "MTPFLOW_LLAMACPP_PYTHON"
    assert set(record["peers"]["vllm"]["runs"]) == {"vllm", "vllm n-gram", "vllm, batch 16"}


def test_a_peer_run_that_fails_is_reported_and_the_rest_goes_on(tiny_dir, tmp_path, fakes, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_PEER_FAIL_BATCH", "1")
    out = tmp_path / "out"
    code = bench.main([f"model={tiny_dir}", f"prompts={prompts_file(tmp_path)}", "strategies=[baseline]",
                       "max_new_tokens=4", "overrides=[trace=off,chat=false]", "peers=[vllm]", "limit=1",
                       f"out={out}"])
    assert code == 0
    err = capsys.readouterr().err
    assert "mtpflow.bench: warning: peer vllm (vllm, batch 16) failed: RuntimeError: out of KV cache (log " in err
    summary = pd.read_csv(out / "bench_summary.csv")
    assert {"vllm", "vllm n-gram"} <= set(summary["strategy"]) and "vllm, batch 16" not in set(summary["strategy"])
    record = json.loads((out / "manifest.json").read_text())
    assert "out of KV cache" in record["peers"]["vllm"]["runs"]["vllm, batch 16"]["error"]
    assert "RuntimeError: out of KV cache" in (out / "peer-vllm.log").read_text()


def test_peers_in_batch_mode(tiny_dir, tmp_path, fakes, capsys):
    """mode=batch peers=[...]: each peer once per batch size on the engine's own prompt ids, after mtpflow, its
    rows in the same table (total tokens/s, against HF at that batch size) and its record in the manifest."""
    out = tmp_path / "out"
    code = bench.main([f"model={tiny_dir}", "mode=batch", f"prompts={prompts_file(tmp_path)}",
                       "strategies=[baseline]", "batch_sizes=[2]", "batch_k=[off]", "max_new_tokens=8",
                       "overrides=[trace=off,chat=false]", "peers=[vllm,llamacpp]", f"peer_gguf={fakes['gguf']}",
                       f"out={out}"])
    assert code == 0, capsys.readouterr().err[-2000:]
    table = pd.read_csv(out / "batch_summary.csv").set_index("setting")
    assert set(table.index) == {"hf_generate", "baseline", "vllm", "llamacpp"}
    for name in ("vllm", "llamacpp"):
        row = table.loc[name]
        assert row["batch_size"] == 2 and row["tokens_per_second"] == pytest.approx(8 / 0.02)
        assert row["vs_hf_batched"] == pytest.approx(400 / table.loc["hf_generate", "tokens_per_second"], rel=1e-2)
        # no HF batch-1 run here: identity against HF's own batch of 2 (the fake answers differ from it)
        assert row["identical_to_hf"] == 0.0 and row["reference"] == "hf_generate, batch 2"
    jobs = [json.loads(line) for line in fakes["jobs"].read_text().splitlines()]
    assert [(j["peer"], j["batch"], j["spec"]) for j in jobs] == [("vllm", 2, "none"), ("llamacpp", 2, "none")]
    tok = make_tiny_tokenizer()
    from mtpflow.request import encode_prompt

    expected = [encode_prompt(tok, p, chat=False) for p in ("the quick brown fox the quick brown fox",
                                                           "def add(a, b): return a + b")]
    assert all(j["prompts"] == expected and j["max_tokens"] == 8 for j in jobs)
    assert jobs[0]["model"] == str(tiny_dir) and jobs[1]["gguf"] == str(fakes["gguf"].resolve())
    record = json.loads((out / "manifest.json").read_text())
    assert set(record["peers"]["vllm"]["runs"]) == {"vllm, batch 2"}
    assert record["peers"]["llamacpp"]["version"] == "9.9-fake"


def run_bench_expecting(args, tmp_path, capsys) -> str:
    out = tmp_path / "out"
    assert bench.main([*args, f"out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtpflow.bench: error:") and "\n" not in err and "Traceback" not in err, err
    assert not out.exists()
    return err


def test_unset_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MTPFLOW_VLLM_PYTHON", raising=False)
    err = run_bench_expecting(["model=/does/not/exist", "peers=[vllm]"], tmp_path, capsys)
    assert err == ("mtpflow.bench: error: peer vllm: set MTPFLOW_VLLM_PYTHON to the python of vllm's own virtual "
                   "environment (docs/benchmarks.md, 'Peers')")


def test_not_an_executable(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MTPFLOW_VLLM_PYTHON", str(tmp_path / "nothing" / "python"))
    err = run_bench_expecting(["model=/does/not/exist", "peers=vllm"], tmp_path, capsys)
    assert f"peer vllm: MTPFLOW_VLLM_PYTHON={tmp_path / 'nothing' / 'python'} is not an executable python" in err


def test_a_python_that_cannot_import_the_engine(tmp_path, fakes, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_PEER_BROKEN", "llama_cpp")
    err = run_bench_expecting(["model=/does/not/exist", "peers=[llamacpp]", f"peer_gguf={fakes['gguf']}"],
                              tmp_path, capsys)
    assert err == (f"mtpflow.bench: error: peer llamacpp: MTPFLOW_LLAMACPP_PYTHON={fakes['python']} cannot import "
                   "llama_cpp (ModuleNotFoundError: No module named 'llama_cpp'); build its venv as "
                   "docs/benchmarks.md, 'Peers' says")
    # the real check, in this python (which has neither engine), answers the same way
    monkeypatch.setenv("MTPFLOW_VLLM_PYTHON", sys.executable)
    err = run_bench_expecting(["model=/does/not/exist", "peers=[vllm]"], tmp_path, capsys)
    assert f"peer vllm: MTPFLOW_VLLM_PYTHON={sys.executable} cannot import vllm (ModuleNotFoundError: " in err


@pytest.mark.parametrize("args,message", [
    (["peers=[tgi]"], "peers: unknown peer 'tgi'; known: vllm, llamacpp"),
    (["peers=[vllm,vllm]"], "names a peer twice"),
    (["mode=cost", "peers=[vllm]"], "peers= adds rows to the decode and batch benchmarks; mode=cost does not run "
                                    "them"),
    (["peers=[llamacpp]"], "peer llamacpp runs a GGUF file: use the default model, model=PATH.gguf, or "
                           "peer_gguf=PATH.gguf (the same weights as model=/does/not/exist)"),
    (["peers=[llamacpp]", "peer_gguf=/no/such.gguf"], "peer_gguf: no file /no/such.gguf"),
])
def test_bad_peer_options(tmp_path, fakes, capsys, args, message):
    err = run_bench_expecting(["model=/does/not/exist", *args], tmp_path, capsys)
    assert message in err


# ---- the worker against fake engine modules -------------------------------------------------------------------

FAKE_ENGINES = {
    "fakerule.py": """
        V, EOS = 97, 2
        def next_token(tokens):
            value = (sum(tokens) * 31 + len(tokens)) % V
            return EOS if value % 13 == 0 else value + 3
        """,
    "vllm/__init__.py": """
        from fakerule import next_token
        __version__ = "0.0-fake"
        class SamplingParams:
            def __init__(self, temperature=0.0, max_tokens=16, stop_token_ids=None, ignore_eos=False):
                self.max_tokens, self.stop = max_tokens, set(stop_token_ids or []) | {2}
        class _Out:
            def __init__(self, ids):
                self.outputs = [type("C", (), {"token_ids": ids})()]
        class _Metric:
            def __init__(self, name, value):
                self.name, self.value = name, value
        class LLM:
            def __init__(self, model, speculative_config=None, **kwargs):
                self.spec, self.counts = speculative_config, {"drafts": 0, "draft_tokens": 0, "accepted": 0}
            def generate(self, inputs, params, use_tqdm=False):
                outs = []
                for one in inputs:
                    seq, out = list(one["prompt_token_ids"]), []
                    while len(out) < params.max_tokens:
                        t = next_token(seq)
                        seq.append(t); out.append(t)
                        if t in params.stop:
                            break
                    if self.spec:
                        self.counts["drafts"] += len(out); self.counts["draft_tokens"] += 4 * len(out)
                        self.counts["accepted"] += len(out) // 2
                    outs.append(_Out(out))
                return outs
            def get_metrics(self):
                c = self.counts
                return [_Metric("vllm:spec_decode_num_drafts", c["drafts"]),
                        _Metric("vllm:spec_decode_num_draft_tokens", c["draft_tokens"]),
                        _Metric("vllm:spec_decode_num_accepted_tokens", c["accepted"])]
        """,
    "llama_cpp/__init__.py": """
        import types
        import numpy as np
        from fakerule import next_token
        __version__ = "0.0-fake"
        def llama_context_default_params():
            return types.SimpleNamespace(n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=1, n_threads=1,
                                         n_threads_batch=1, kv_unified=False)
        def llama_memory_seq_rm(memory, seq, p0, p1):
            memory.pop(seq, None)
            return True
        class Llama:
            def __init__(self, model_path, draft_model=None, **kwargs):
                self.draft, self._model, self.tokens = draft_model, object(), []
            def n_vocab(self):
                return 100
            def token_eos(self):
                return 2
            def reset(self):
                self.tokens = []
            def eval(self, tokens):
                self.tokens = self.tokens + list(tokens)
            def generate(self, tokens, temp=0.8, reset=True, **kwargs):
                assert temp == 0.0 and not self.tokens
                self.eval(tokens)
                while True:
                    t = next_token(self.tokens)
                    yield t
                    draft = list(self.draft(np.array(self.tokens + [t]))) if self.draft else []
                    ok = []  # the drafts the target agrees with, checked in the same forward
                    for d in draft:
                        if d != next_token(self.tokens + [t] + ok):
                            break
                        ok.append(int(d))
                    self.eval([t] + draft)
                    self.tokens = self.tokens[:len(self.tokens) - len(draft) + len(ok)]
                    for d in ok:
                        yield d
        """,
    "llama_cpp/llama_speculative.py": """
        import numpy as np
        class LlamaPromptLookupDecoding:
            def __init__(self, max_ngram_size=2, num_pred_tokens=10):
                self.n = num_pred_tokens
            def __call__(self, input_ids):
                ids = list(input_ids)
                for i in range(len(ids) - 2, -1, -1):
                    if ids[i] == ids[-1]:
                        return np.array(ids[i + 1:i + 1 + self.n], dtype=np.intc)
                return np.array([], dtype=np.intc)
        """,
    "llama_cpp/_internals.py": """
        import ctypes
        import types
        from fakerule import next_token
        class LlamaBatch:
            def __init__(self, n_tokens, embd, n_seq_max, verbose=True):
                self.batch = types.SimpleNamespace(n_tokens=0, token=[0] * n_tokens, pos=[0] * n_tokens,
                                                   seq_id=[[0] for _ in range(n_tokens)], n_seq_id=[0] * n_tokens,
                                                   logits=[False] * n_tokens)
            def close(self):
                pass
        class LlamaContext:
            def __init__(self, model, params, verbose=True):
                assert params.n_seq_max >= 2
                self.memory, self.rows, self.params = {}, {}, params
            def decode(self, batch):
                b = batch.batch
                for j in range(b.n_tokens):  # a sequence's cells must arrive in position order
                    cells = self.memory.setdefault(b.seq_id[j][0], [])
                    assert b.pos[j] == len(cells), (b.pos[j], len(cells))
                    cells.append(b.token[j])
                    if b.logits[j]:
                        row = (ctypes.c_float * 100)()
                        row[next_token(cells)] = 1.0
                        self.rows[j] = row
            def get_logits_ith(self, j):
                return ctypes.cast(self.rows[j], ctypes.POINTER(ctypes.c_float))
            def close(self):
                pass
        """,
}


def run_worker(tmp_path: Path, job: dict) -> dict:
    lib = tmp_path / "fake-engines"
    for rel, text in FAKE_ENGINES.items():
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": str(lib)}
    done = subprocess.run([sys.executable, "-c", peers.BOOT, peers.__file__, "--run"], input=json.dumps(job),
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    events = peers._events(done.stdout)
    assert done.returncode == 0, (done.stderr[-2000:], events)
    assert [e["event"] for e in events][:2] == ["ready", "loaded"]
    return next(e for e in events if e["event"] == "result")


def expected_greedy(prompt, max_tokens):
    import importlib.util

    spec = importlib.util.spec_from_loader("fakerule", loader=None)
    rule = importlib.util.module_from_spec(spec)
    exec(textwrap.dedent(FAKE_ENGINES["fakerule.py"]), rule.__dict__)
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        t = rule.next_token(seq)
        seq.append(t)
        out.append(t)
        if t == rule.EOS:
            break
    return out


@pytest.mark.parametrize("peer", ["vllm", "llamacpp"])
def test_worker_runs_against_the_engines_api(tmp_path, peer):
    prompts = [[5, 9, 14, 5, 9], [7, 7, 7, 7], [11, 3], [40, 41, 42, 40, 41], [1, 2, 3]]
    want = [expected_greedy(p, 12) for p in prompts]
    assert any(len(w) < 12 for w in want) and any(len(w) == 12 for w in want)  # some end at EOS
    runs = {r["spec"] if r["batch"] == 1 else "batch": r for r in peers.runs_for(peer)}
    for key, run in runs.items():
        job = peers.job_for(peer, {**run, "batch": 3 if key == "batch" else 1}, prompts, max_tokens=12,
                            stop_ids=[2], threads=2, model_folder="/m", gguf="/m.gguf")
        result = run_worker(tmp_path, job)
        assert result["token_ids"] == want, key  # batch 3 over 5 prompts: slots are reused
        if key == "batch":
            assert result["seconds"] is None and result["total_seconds"] > 0
        else:
            assert len(result["seconds"]) == len(prompts) and len(result["steps"]) == len(prompts)
            assert all(1 <= s <= len(w) for s, w in zip(result["steps"], want))
    if peer == "vllm":
        assert result["config"]["enable_prefix_caching"] is False


def test_the_vllm_tool_runs_without_mtpflows_dependencies():
    """``python -m mtpflow.tools.peer_vllm`` (vLLM's own options: EAGLE drafts, --dump) runs in vLLM's environment,
    where mtpflow is not installed: importing it loads no third-party package, and it reads vLLM's counters with
    peers.py's own functions."""
    code = ("import sys; import mtpflow.tools.peer_vllm as tool, mtpflow.tools.peers as peers; "
            "assert tool.spec_delta is peers.spec_delta; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy', 'omegaconf', "
            "'hydra', 'pluggy', 'vllm'}))")
    root = Path(peers.__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    before, after = {"num_drafts": 1}, {"num_drafts": 3, "num_draft_tokens": 8, "num_accepted_tokens": 4}
    assert peers.spec_delta(before, after)["mean_acceptance_length"] == 3.0
