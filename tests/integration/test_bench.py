"""The benchmark command: prompt suite, oracle lookup ceiling, best-of-repeats summary, and an end-to-end run
(decode and cost modes) on a tiny model saved to disk."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from omegaconf import OmegaConf

from helpers import save_tiny_model
from mtpflow.tools import bench
from mtpflow.errors import ConfigError, UserError


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
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=2)


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


def test_variants_first_time_and_repeated_requests(tiny_dir, tmp_path):
    """A strategies entry may carry its own overrides (``name|override``); every pass starts with empty shared
    caches, so each measures first-time requests; ``repeated`` runs the named ones once more with the caches
    kept, and the suffix cache then drafts the whole earlier output."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"id": "x1", "class": "a", "prompt": "one two three four five six"},
        {"id": "x2", "class": "b", "prompt": "def add(a, b): return a + b"},
    ]))
    out = tmp_path / "out"
    variant = "suffix_cache|strategy.select_k.k=24|strategy.prune=[]"
    code = bench.main([f"model={tiny_dir}", f"prompts={prompts}", f"strategies=[baseline,'{variant}']", "repeats=2",
                       f"repeated=['{variant}']", "max_new_tokens=24", "overrides=[trace=off,chat=false]",
                       f"out={out}"])
    assert code == 0
    runs = pd.read_csv(out / "bench_runs.csv")
    assert len(runs) == 2 * 2 * 3 + 2
    first = runs[runs["strategy"] == variant]
    again = runs[runs["strategy"] == f"{variant}, repeated"]
    assert len(first) == 4 and len(again) == 2 and runs["identical"].all()
    # the second pass drafted no more than the first: its cache was cleared, the same prompts came before
    assert (first.groupby("id")["mal"].nunique() == 1).all()
    assert again["mal"].min() > first["mal"].max()


def test_cost_mode_end_to_end(tiny_dir, tmp_path):
    """``backends=both`` (the default) measures each backend that applies: hf always, native_cpu where the
    kernels build (the tiny model is a float32 Llama on SDPA); ``backends=hf`` only hf."""
    from mtpflow.backends.native import kernel, products

    code = bench.main([f"model={tiny_dir}", "mode=cost", "cost_ks=[0,1,4]", "cost_context=16", f"out={tmp_path}"])
    assert code == 0
    table = pd.read_csv(tmp_path / "verify_cost.csv")
    assert set(table["backend"]) == ({"hf", "native_cpu"} if kernel.available() else {"hf"})
    assert len(table) == 3 * table["backend"].nunique() and set(table["k"]) == {0, 1, 4}
    assert (table.loc[table["k"] == 0, "cost_vs_k0"] == 1.0).all()
    out = tmp_path / "hf_only"
    assert bench.main([f"model={tiny_dir}", "mode=cost", "backends=hf", "cost_ks=[0,2]", "cost_context=16",
                       f"out={out}"]) == 0
    table = pd.read_csv(out / "verify_cost.csv")
    assert set(table["backend"]) == {"hf"} and set(table["k"]) == {0, 2}


def test_bad_options_exit_2(capsys):
    assert bench.main(["nonsense=1"]) == 2
    assert bench.main(["mode=cost", "backends=maybe", "model=/does/not/exist"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("mtpflow.bench: error:") for line in err)


def test_options_are_checked_before_the_model_loads(tmp_path, capsys):
    """Each mistake is one line and exit 2 before any model loads (the model path here does not exist, so a
    check that came after loading would report the model instead); these were tracebacks."""
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"title": "no prompt"}\n')
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cases = {"repeats=0": "repeats must be a whole number >= 1", "repeats=abc": "repeats must be a whole number",
             "limit=-1": "limit must be a whole number >= 0", "max_new_tokens=0": "max_new_tokens must be",
             "strategies=[]": "strategies must name at least one", "cost_ks=[0,-1]": "cost_ks must be",
             f"out={blocker / 'out'}": "cannot write to",
             "strategies=[pld,'mtp|']": "must be a strategy name, optionally followed by |override",
             "repeated=[mtp]": "repeated names ['mtp'], which strategies does not list"}
    for option, message in cases.items():
        out = [] if option.startswith("out=") else [f"out={tmp_path / 'out'}"]  # the option's own out wins
        assert bench.main(["model=/does/not/exist", *out, option]) == 2, option
        err = capsys.readouterr().err.strip()
        assert err.startswith("mtpflow.bench: error:") and message in err and "\n" not in err, (option, err)
    with pytest.raises(UserError, match="cannot read the prompt file"):
        bench.load_prompt_suite(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="every line must be a JSON object with a 'prompt'"):
        bench.load_prompt_suite(str(bad_json))
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "first"}\n{"prompt": "second", "class": "mine"}\n')
    assert [(r["id"], r["class"]) for r in bench.load_prompt_suite(str(plain))] == [("0", "all"), ("1", "mine")]
    opts = OmegaConf.merge(OmegaConf.create(bench.DEFAULTS), OmegaConf.from_dotlist(["strategies=pld", "classes=chat"]))
    bench.check_options(opts)  # one name without brackets is a list of one
    assert list(opts.strategies) == ["pld"] and list(opts.classes) == ["chat"]
    opts = OmegaConf.merge(OmegaConf.create(bench.DEFAULTS), OmegaConf.from_dotlist(["batch_k=[off]"]))
    bench.check_options(opts)  # YAML reads a bare off as false: still the setting "off"
    assert list(opts.batch_k) == ["off"]
    opts = OmegaConf.merge(OmegaConf.create(bench.DEFAULTS), OmegaConf.from_dotlist(["batch_k=[auto,sometimes]"]))
    with pytest.raises(ConfigError, match="batch_k must be auto or off, got 'sometimes'"):
        bench.check_options(opts)  # the engine's own check (mtpflow.config.check_batch_k)


def test_batch_mode_measures_first_time_requests(tiny_dir, tmp_path):
    """mode=batch: HF batched and each strategy per batch size, outputs identical to HF batch-1 greedy; every
    setting starts with empty shared caches, so ``suffix_cache`` drafts no more at its second setting (with the
    batch-aware K) than a first-time request allows."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"x{i}", "class": "a", "prompt": p}) for i, p in enumerate(
        ["one two three four five six", "def add(a, b): return a + b", "a b a b a b a b"])))
    out = tmp_path / "out"
    code = bench.main([f"model={tiny_dir}", "mode=batch", f"prompts={prompts}",
                       "strategies=[baseline,suffix_cache]", "batch_sizes=[1,2]", "max_new_tokens=16",
                       "overrides=[chat=false]", f"out={out}"])
    assert code == 0
    table = pd.read_csv(out / "batch_summary.csv")
    assert set(table["batch_size"]) == {1, 2}
    assert set(table["setting"]) == {"hf_generate", "baseline", "suffix_cache", "suffix_cache+batch_k"}
    engine_rows = table[table["setting"] != "hf_generate"]
    assert (engine_rows["identical_to_hf"] == 1.0).all()
    first = table[(table["setting"] == "suffix_cache") & (table["batch_size"] == 1)]["mal"].iloc[0]
    # the same prompts again at batch 2 (and with batch K) would draft whole outputs from a kept cache
    assert table[table["setting"].str.startswith("suffix_cache")]["mal"].max() < first + 1.0


def test_batch_mode_over_the_int8_model_checks_the_int8_reference(tiny_dir, tmp_path):
    """mode=batch over the int8 model: HF generate runs on the float model loaded beside it, and the engine's
    answers equal the int8 reference's greedy (they need not equal HF's)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"x{i}", "class": "a", "prompt": p}) for i, p in enumerate(
        ["one two three four five six", "def add(a, b): return a + b"])))
    out = tmp_path / "out"
    code = bench.main([f"model={tiny_dir}", "mode=batch", f"prompts={prompts}", "strategies=[baseline,pld]",
                       "batch_sizes=[2]", "batch_k=[off]", "max_new_tokens=12",
                       "overrides=[chat=false,model.quantize=int8]", f"out={out}"])
    assert code == 0
    table = pd.read_csv(out / "batch_summary.csv")
    engine_rows = table[table["setting"] != "hf_generate"]
    assert list(engine_rows["reference"]) == ["int8_reference", "int8_reference"]
    assert (engine_rows["identical_to_hf"] == 1.0).all()
    assert table[table["setting"] == "hf_generate"]["reference"].iloc[0] == "hf_generate"
