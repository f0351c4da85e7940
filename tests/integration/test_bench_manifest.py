"""Every bench mode (decode, batch, cost, serve) writes ``manifest.json`` beside its CSVs and PNGs with every
field: commit and dirty flag, date, command, CPU model and flags, threads, GPU (null on the CPU), library
versions, model, dtype, backend, the tuning profile's hash, the settings and a SHA-256 of each file. Tiny
model, tiny settings."""
from __future__ import annotations

import datetime
import hashlib
import json
import shlex

import pytest

from helpers import make_tiny_model, make_tiny_tokenizer
from mtpflow.tools import bench, manifest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tok = make_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # the server speaks chat
    make_tiny_model(len(tok), seed=2).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text('{"id": "a", "class": "x", "prompt": "one two three one two three"}\n'
                    '{"id": "b", "class": "y", "prompt": "def add(a, b): return a + b"}\n')
    return path


def check_complete(out, mode: str, args: list[str], files: list[str], model: str) -> dict:
    record = json.loads((out / "manifest.json").read_text())
    assert set(manifest.REQUIRED) <= set(record), set(manifest.REQUIRED) - set(record)
    assert record["mode"] == mode and record["schema"] == manifest.SCHEMA
    assert record["command"] == shlex.join(["python", "-m", "mtpflow.bench", *args])
    assert datetime.datetime.fromisoformat(record["date"]).tzinfo is not None
    git = record["git"]
    assert set(git) == {"commit", "dirty", "describe"}
    assert git["commit"] is None or (len(git["commit"]) == 40 and isinstance(git["dirty"], bool))
    cpu = record["host"]["cpu"]
    assert set(cpu["flags"]) == set(manifest.CPU_FLAGS) and cpu["usable_cpus"] >= 1
    assert record["host"]["torch_threads"] >= 1
    assert record["gpu"] is None  # a CPU run
    assert record["versions"]["torch"] and record["versions"]["transformers"] and "triton" in record["versions"]
    assert record["model"]["name"] == model and record["model"]["backend"]
    assert record["model"]["dtype"] in ("float32", "auto") and record["model"]["device"] == "cpu"
    assert record["profile_hash"] is None or isinstance(record["profile_hash"], str)
    assert record["settings"]["mode"] == mode
    assert set(record["files"]) == set(files)
    for name, info in record["files"].items():
        data = (out / name).read_bytes()
        assert info == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return record


def test_decode_manifest(tiny_dir, prompts, tmp_path):
    out = tmp_path / "out"
    args = [f"model={tiny_dir}", f"prompts={prompts}", "limit=1", "strategies=[baseline]", "max_new_tokens=4",
            "overrides=[trace=off,chat=false]", f"out={out}"]
    assert bench.main(args) == 0
    record = check_complete(out, "decode", args, ["bench_runs.csv", "bench_summary.csv", "bench_speedup.png"],
                            str(tiny_dir))
    assert record["settings"]["prompt_count"] == 2 and record["settings"]["strategies"] == ["baseline"]


def test_batch_manifest(tiny_dir, prompts, tmp_path):
    out = tmp_path / "out"
    args = [f"model={tiny_dir}", "mode=batch", f"prompts={prompts}", "strategies=[baseline]", "batch_sizes=[1]",
            "max_new_tokens=4", "overrides=[chat=false]", f"out={out}"]
    assert bench.main(args) == 0
    check_complete(out, "batch", args, ["batch_summary.csv", "batch_throughput.png"], str(tiny_dir))


def test_cost_manifest(tiny_dir, tmp_path):
    out = tmp_path / "out"
    args = [f"model={tiny_dir}", "mode=cost", "cost_ks=[0,1]", "cost_context=8", f"out={out}"]
    assert bench.main(args) == 0
    check_complete(out, "cost", args, ["verify_cost.csv", "verify_cost.png"], str(tiny_dir))


def test_serve_manifest(tiny_dir, tmp_path):
    out = tmp_path / "out"
    args = ["mode=serve", f"model={tiny_dir}", "strategies=[baseline]", "concurrency=[1]", "requests=1",
            "max_new_tokens=4", "limit=1", f"out={out}"]
    assert bench.main(args) == 0
    record = check_complete(out, "serve", args, ["serve_bench.csv", "serve_bench.png"], str(tiny_dir))
    assert record["model"]["id"]  # the id the server answered on /v1/models
    assert not any(o.startswith("trace.db=") for o in record["settings"]["server_overrides"])


@pytest.mark.skipif(not __import__("mtpflow.backends.native.kernel", fromlist=["x"]).available(),
                    reason="the int8 model needs the native kernels")
def test_int8_bench_is_one_run_with_one_manifest(tiny_dir, prompts, tmp_path):
    """``python -m mtpflow.tools.int8_bench``: the decode rows (float32 baseline, strategies over the int8 model
    checked against the int8 reference), the batch rows, the agreement with float32, and the manifest naming
    every file with the bandwidth and the int8 facts."""
    import pandas as pd

    from mtpflow.tools import int8_bench

    out = tmp_path / "out"
    args = [f"model={tiny_dir}", f"prompts={prompts}", "limit=1", "strategies=[baseline,pld]", "max_new_tokens=6",
            "batch=2", "overrides=[trace=off,chat=false]", f"out={out}"]
    assert int8_bench.main(args) == 0
    record = json.loads((out / "manifest.json").read_text())
    assert set(record["files"]) == {"bench_runs.csv", "bench_summary.csv", "bench_speedup.png", "int8_batch.csv",
                                    "int8_agreement.csv", "int8_decode_steps.csv"}
    facts = record["int8"]
    assert facts["memory_bandwidth_gbs"] > 0 and facts["int8_weight_bytes_per_token"] > 0
    # the steps are held to the faster of the two readings; the weights' huge pages are reported, within their
    # size (a tiny model's weights are below one huge page: plain memory, where smaps may count a neighbour's)
    assert facts["memory_bandwidth_gbs"] == max(facts["memory_bandwidth_plain_pages_gbs"],
                                                facts["memory_bandwidth_huge_pages_gbs"])
    assert 0 <= facts["int8_weights_huge_pages_mb"] <= round(facts["int8_weight_bytes_per_token"] / 2**20, 1) + 0.1
    assert facts["int8_backend"].startswith("native_cpu cpu int8 w8a8") and facts["int8_baseline_identical"] == "2/2"
    assert record["command"].startswith("python -m mtpflow.tools.int8_bench ")
    summary = pd.read_csv(out / "bench_summary.csv")
    overall = summary[summary["class"] == "overall"].set_index("strategy")
    assert overall.loc["baseline|model.quantize=int8", "identical"] == "2/2"
    assert overall.loc["pld|model.quantize=int8", "identical"] == "2/2"
    assert overall.loc["baseline", "identical"] == "2/2"  # float32, against HF generate
    batch = pd.read_csv(out / "int8_batch.csv")
    assert list(batch["setting"])[:2] == ["float32 baseline", "int8 baseline"] and (batch["identical"] == "2/2").all()
    agreement = pd.read_csv(out / "int8_agreement.csv")
    assert len(agreement) == 2 and agreement["next_token_agreement"].between(0, 1).all()
    steps = pd.read_csv(out / "int8_decode_steps.csv")
    # a step's time is a difference of two timings: on this tiny model it may be no measurement (NaN), never <= 0
    assert list(steps["setting"]) == ["float32 baseline", "int8 baseline"] and not (steps["step_ms"] <= 0).any()


@pytest.mark.skipif(not __import__("mtpflow.backends.native.kernel", fromlist=["x"]).available(),
                    reason="the int8 model needs the native kernels")
def test_the_real_size_check_runs_each_precision_in_its_own_process(tmp_path):
    """``python -m mtpflow.tools.realsize`` on a tiny shape: a row per precision with step times at batch 1 and 16
    and resident sizes, the int8 one on the int8 backend; a manifest naming the CSV."""
    import pandas as pd

    from mtpflow.tools import realsize

    out = tmp_path / "out"
    tiny = ["shape.num_hidden_layers=2", "shape.hidden_size=64", "shape.intermediate_size=128",
            "shape.num_attention_heads=4", "shape.num_key_value_heads=2", "shape.vocab_size=300"]
    assert realsize.main([*tiny, "context=8", "repeats=1", f"out={out}"]) == 0
    table = pd.read_csv(out / "realsize.csv").set_index("precision")
    assert table.loc["int8", "backend"].startswith("native_cpu cpu int8 w8a8")
    assert table.loc["float32", "backend"].startswith("native_cpu cpu float32")
    for column in ("ms_b1_rows1", "ms_b16_rows4", "rss_after_steps_mb", "peak_rss_mb"):
        assert (table[column] > 0).all(), column
    record = json.loads((out / "manifest.json").read_text())
    assert set(record["files"]) == {"realsize.csv"} and record["model"]["shape"]["hidden_size"] == 64


def test_manifest_pieces_tolerate_a_bare_host(tmp_path):
    """No git checkout, no /proc/cpuinfo flags: nulls, not errors."""
    assert manifest.git_info(tmp_path) == {"commit": None, "dirty": None, "describe": None}
    info = manifest.cpu_info("")
    assert info["flags"] == {f: None for f in manifest.CPU_FLAGS}
    amx = manifest.cpu_info("model name\t: Some Xeon\nflags\t\t: sse avx2 avx512f amx_tile amx_bf16\n")
    assert amx["model"] == "Some Xeon"
    assert amx["flags"] == {"avx2": True, "avx512f": True, "avx512_vnni": False, "amx": True}
    assert manifest.host_line({"host": {"cpu": {**amx, "usable_cpus": 2}}}) == "Some Xeon (2 cores, AVX-512 + AMX)"
    assert manifest.gpu_info("cpu") is None
