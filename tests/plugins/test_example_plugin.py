"""Integration: the example package (examples/mtpflow-plugin-example, pip-installed by install.sh) is listed by
``python -m mtpflow.plugins``, its ``suffix`` strategy runs end to end on the default model, token-identical
to HF greedy, its proposer's calls show up in the run's steps and stats, and its own test suite passes."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import hf_greedy, make_pipeline
from mtpflow.plugins import entry_points

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mtpflow-plugin-example"
PROMPT = "List three uses of a paper clip, one per line."


@pytest.fixture(autouse=True)
def example_loaded(monkeypatch):
    try:
        importlib.metadata.distribution("mtpflow-plugin-example")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("mtpflow-plugin-example is not installed: run ./install.sh "
                    "(pip install --no-build-isolation -e examples/mtpflow-plugin-example)")
    monkeypatch.setenv(entry_points.SELECT_ENV, "example")
    entry_points.clear_cache()
    yield
    entry_points.clear_cache()


def run(*args: str, selection: str = "example", timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, entry_points.SELECT_ENV: selection}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_listed_with_its_hooks_and_strategy():
    out = run("-m", "mtpflow.plugins", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    (example,) = [p for p in info["third_party"] if p["name"] == "example"]
    assert example["status"] == "loaded" and example["distribution"] == "mtpflow-plugin-example 0.1.0"
    assert example["hooks"] == ["mtpflow_strategy_dirs"] and example["strategies"] == ["suffix"]
    assert example["stage_classes"] == {
        "mtpflow_plugin_example.suffix.SuffixProposer": ["on_run_end", "on_run_start", "on_step_end", "propose",
                                                         "run_stats"]}
    assert "suffix" not in info["builtin"]["strategies"]



def test_listing_follows_a_strategy_built_on_another(tmp_path):
    """A strategy YAML whose Hydra defaults list names another (``mtp`` builds on ``suffix_cache``) lists the
    stage classes the composed strategy has (its own where it overrides a stage); a defaults entry that is not a
    plain name is skipped."""
    from mtpflow.conf import conf_dir
    from mtpflow.plugins.__main__ import strategy_targets

    (tmp_path / "base.yaml").write_text("propose: {_target_: a.Proposer}\ngate: {_target_: a.Gate}\n")
    (tmp_path / "child.yaml").write_text("defaults:\n  - base\n  - {x: y}\n  - _self_\n"
                                         "gate: {_target_: b.Gate}\n")
    assert strategy_targets(tmp_path) == {"base": ["a.Gate", "a.Proposer"],
                                          "child": ["a.Proposer", "b.Gate"]}
    builtin = strategy_targets(conf_dir() / "strategy")
    assert builtin["mtp"] == builtin["suffix_cache"] and "mtpflow.strategies.suffix.SuffixProposer" in builtin["mtp"]


def test_listing_says_when_the_variable_keeps_it_out(monkeypatch):
    from mtpflow.plugins.__main__ import describe, format_listing

    monkeypatch.setenv(entry_points.SELECT_ENV, "")
    text = format_listing(describe())
    assert "MTPFLOW_LOAD_PLUGINS empty: none load" in text
    assert "example = mtpflow_plugin_example  [mtpflow-plugin-example 0.1.0]  not loaded" in text


@pytest.mark.default_model
def test_suffix_strategy_is_lossless_and_learns_from_earlier_outputs(default_loaded):
    from mtpflow_plugin_example import suffix

    suffix.HISTORIES.clear()
    pipe = make_pipeline(default_loaded, "suffix", "max_new_tokens=32")
    first, again = pipe(PROMPT), pipe(PROMPT)
    expected = hf_greedy(default_loaded.model, pipe.encode(PROMPT), 32)
    assert first.token_ids == expected and again.token_ids == expected
    assert (first.stats["suffix_history_outputs"], again.stats["suffix_history_outputs"]) == (0, 1)
    drafted = [s for s in again.steps if s.draft.source == "suffix" and s.draft.num_nodes]
    assert drafted and all("propose" in s.stage_seconds for s in drafted)
    assert again.stats["accepted_tokens"] >= 0.8 * len(expected)  # the earlier answer is drafted back
    assert again.stats["suffix_drafts"] == len(drafted)  # the plugin's run_stats hook reached the stats
    assert again.stats["suffix_accepted_tokens"] == again.stats["accepted_tokens"]
    assert again.stats["mal"] > 2 * first.stats["mal"]
    suffix.HISTORIES.clear()


@pytest.mark.default_model
def test_cli_runs_the_plugin_strategy():
    out = run("-m", "mtpflow", "strategy=suffix", f"prompt={PROMPT}", "max_new_tokens=8", "output=json", "trace=off")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["strategy"] == "suffix" and doc["stats"]["new_tokens"] == 8
    assert doc["stats"]["suffix_history_outputs"] == 0  # a fresh process starts with an empty history


def test_example_package_tests_pass():
    out = run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests"), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
