"""The benchmark command: prompt suite, oracle lookup ceiling, best-of-repeats summary, and an end-to-end run
(decode and cost modes) on a tiny model saved to disk."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from helpers import make_tiny_model, make_tiny_tokenizer
from mtpflow import bench


def test_shipped_suite_has_four_classes_of_prompts():
    rows = bench.load_prompt_suite()
    classes = {r["class"] for r in rows}
    assert len(rows) >= 24 and classes == {"summarize/extract", "rewrite/code-edit", "open chat", "reasoning/QA"}
    assert all(sum(r["class"] == c for r in rows) >= 6 for c in classes)
    assert len(bench.load_prompt_suite(limit=1)) == 4
    assert {r["class"] for r in bench.load_prompt_suite(classes=["open chat"])} == {"open chat"}


def test_lookup_ceiling_steps():
    # the output copies the prompt: one prefill token, then one step drafts the remaining four
    assert bench.lookup_ceiling_steps([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == 2
    assert bench.lookup_ceiling_steps([7, 8], [1, 2, 3]) == 3  # nothing to copy: one token per step
    assert bench.lookup_ceiling_steps([7, 8], []) == 0
    # drafts are capped at max_draft tokens per step
    assert bench.lookup_ceiling_steps(list(range(1, 21)), list(range(1, 21)), max_draft=4) == 1 + 4  # 19 = 5+5+5+4


def test_best_of_repeats_and_summary():
    rows = []
    for rep, (hf_s, pld_s, same) in enumerate([(2.0, 1.0, True), (1.0, 3.0, True)]):
        rows.append({"id": "a", "class": "c", "strategy": "hf_generate", "repeat": rep, "tokens": 10,
                     "seconds": hf_s, "steps": 10, "mal": 1.0, "identical": True, "lookup_ceiling_steps": 4})
        rows.append({"id": "a", "class": "c", "strategy": "pld", "repeat": rep, "tokens": 10, "seconds": pld_s,
                     "steps": 4, "mal": 3.0, "identical": same})
    table = bench.summarize(pd.DataFrame(rows)).set_index(["strategy", "class"])
    # fastest of each: HF 1.0 s, pld 1.0 s -> 1.0x; MAL (10 - 1) / (4 - 1)
    assert table.loc[("pld", "c"), "speedup_vs_hf"] == pytest.approx(1.0)
    assert table.loc[("pld", "overall"), "mal"] == pytest.approx(3.0)
    assert table.loc[("hf_generate", "c"), "lookup_ceiling_mal"] == pytest.approx(3.0)
    rows[-1]["identical"] = False  # one repeat differs: the prompt is not identical
    table = bench.summarize(pd.DataFrame(rows)).set_index(["strategy", "class"])
    assert table.loc[("pld", "c"), "identical"] == "0/1"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tok = make_tiny_tokenizer()
    make_tiny_model(len(tok), seed=2).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_decode_bench_end_to_end(tiny_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"id": "x1", "class": "summarize/extract", "prompt": "the quick brown fox the quick brown fox"},
        {"id": "x2", "class": "open chat", "prompt": "def add(a, b): return a + b"},
    ]))
    out = tmp_path / "out"
    code = bench.main([f"model={tiny_dir}", f"prompts={prompts}", "strategies=[baseline,pld]", "repeats=2",
                       "max_new_tokens=12", "overrides=[trace=off,chat=false]", f"out={out}"])
    assert code == 0
    runs = pd.read_csv(out / "bench_runs.csv")
    assert len(runs) == 2 * 2 * 3 and set(runs["repeat"]) == {0, 1}
    summary = pd.read_csv(out / "bench_summary.csv")
    assert set(summary["strategy"]) == {"hf_generate", "baseline", "pld"}
    assert (summary["identical"] == summary["prompts"].astype(str) + "/" + summary["prompts"].astype(str)).all()
    assert (out / "bench_speedup.png").stat().st_size > 0


def test_cost_mode_end_to_end(tiny_dir, tmp_path):
    code = bench.main([f"model={tiny_dir}", "mode=cost", "cost_ks=[0,1,4]", "cost_context=16", f"out={tmp_path}"])
    assert code == 0
    table = pd.read_csv(tmp_path / "verify_cost.csv")
    from mtpflow.kernels import cpu_linear

    kinds = {"stock", "packed"} if cpu_linear.available() else {"stock"}
    assert set(table["linear"]) == kinds and set(table["k"]) == {0, 1, 4}
    assert (table.loc[table["k"] == 0, "cost_vs_k0"] == 1.0).all()


def test_bad_options_exit_2(capsys):
    assert bench.main(["nonsense=1"]) == 2
    assert bench.main(["mode=cost", "cpu_linear=maybe", "model=/does/not/exist"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("mtpflow.bench: error:") for line in err)
