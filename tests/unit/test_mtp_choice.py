"""``mtp`` is chosen by measurement (``mtpflow.strategy_choice``, ``mtpflow.tools.tune_choice``): the tuner stores the
fastest lossless candidate in the tuning profile, ``strategy=mtp`` runs it and names it (``mtp -> pld``) in the CLI,
the result's stats, the trace and the server's figures; without a stored choice, or with one that cannot run here,
mtp runs suffix_cache and says so in one line; whatever runs is token-identical to HF greedy."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import hf_greedy, make_pipeline, save_tiny_model
from mtpflow import host
from mtpflow.backends.native import kernel
from mtpflow.config import compose
from mtpflow.engine import Engine
from mtpflow.plugins.manager import default_run_plugins
from mtpflow.strategy_choice import choice_key

FIXTURE = Path(__file__).parent.parent / "fixtures" / "profile.json"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 40, 41, 42, 40, 41], [100, 7, 33, 2, 100, 7]]
NOTICE_START = "mtpflow: no measured choice for strategy mtp"


@pytest.fixture(scope="module")
def engine(tiny):
    """An engine on the suite's fixed profile, which holds no choice."""
    with Engine(compose(["strategy=baseline", "trace=off"]), loaded=tiny) as e:
        yield e


def profile_with_choice(path, engine, chosen) -> Path:
    """The suite's fixed profile plus ``engine``'s entry (the fixed costs, so nothing is timed) naming ``chosen``."""
    data = json.loads(FIXTURE.read_text())
    entry = dict(data["entries"]["default"])
    entry["choice"] = {"mtp": {"chosen": chosen, "tokens_per_second": {chosen: 100.0}}}
    data["entries"][choice_key(engine.backend, engine.loaded)] = entry
    path.write_text(json.dumps(data))
    return path


def engine_on(tiny, path, *overrides, **kwargs) -> Engine:
    """An engine that reads the profile at ``path`` (the profile is the engine's, as every cost it reads)."""
    return Engine(compose(["strategy=baseline", "trace=off", f"profile={path}", *overrides]), loaded=tiny, **kwargs)


def mtp_pipeline(engine, *overrides):
    from mtpflow.api import Pipeline

    return Pipeline(compose(["strategy=mtp", "max_new_tokens=24", "trace=off", *overrides]), engine=engine)


@pytest.mark.parametrize("chosen", ["pld", "recycling", "baseline", "suffix_cache"])
def test_mtp_runs_the_stored_choice_names_it_and_stays_lossless(tiny, engine, tmp_path, chosen, capsys):
    path = profile_with_choice(tmp_path / "p.json", engine, chosen)
    with engine_on(tiny, path) as mine:
        pipe = mtp_pipeline(mine)
        own = compose([f"strategy={chosen}"]).strategy
        assert pipe.strategy_name == f"mtp -> {chosen}"
        assert pipe.cfg.strategy.propose == own.propose and pipe.cfg.strategy.chosen_by == "measured"
        for ids in PROMPTS:
            result = pipe(prompt_ids=ids)
            assert result.token_ids == hf_greedy(tiny.model, ids, 24), (chosen, ids)
            assert result.stats["strategy"] == f"mtp -> {chosen}"
    assert NOTICE_START not in capsys.readouterr().err


def test_mtp_runs_the_head_tree_where_the_model_has_heads_and_stays_lossless(tiny, engine, tmp_path, capsys):
    from test_heads_lossless import random_heads

    folder = random_heads(tiny, "medusa", tmp_path / "medusa")
    path = profile_with_choice(tmp_path / "p.json", engine, "mtp_heads")
    with engine_on(tiny, path, "model.name=tiny-llama-0", f"model.heads={folder}") as mine:
        pipe = mtp_pipeline(mine)
        assert pipe.strategy_name == "mtp -> mtp_heads"
        for ids in PROMPTS:
            result = pipe(prompt_ids=ids)
            assert result.token_ids == hf_greedy(tiny.model, ids, 24), ids
            assert result.stats["heads"] in (str(folder), str(folder / "medusa"))
    assert "mtpflow: the tuning profile chose" not in capsys.readouterr().err


def test_without_a_stored_choice_mtp_runs_suffix_cache_with_one_notice(tiny, engine, capsys):
    pipe = mtp_pipeline(engine)  # the suite's fixed profile holds no choice
    assert pipe.strategy_name == "mtp -> suffix_cache" and pipe.cfg.strategy.chosen_by == "default"
    result = pipe(prompt_ids=PROMPTS[0])
    assert result.token_ids == hf_greedy(tiny.model, PROMPTS[0], 24)
    # an engine says it once, however many pipelines and requests ask for mtp
    mtp_pipeline(engine)(prompt_ids=PROMPTS[1])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mtpflow: no measured")]
    assert line.startswith(NOTICE_START) and "running suffix_cache" in line
    assert "python -m mtpflow.tune strategy=mtp" in line


@pytest.mark.parametrize("chosen, why", [("nonexistent", "is not one of its candidates"),
                                         ("mtp_heads", "cannot run: no trained medusa heads"),
                                         ("typical", "is not one of its candidates")])
def test_a_choice_that_cannot_run_here_falls_back_in_one_line(tiny, engine, tmp_path, chosen, why, capsys):
    path = profile_with_choice(tmp_path / "p.json", engine, chosen)
    with engine_on(tiny, path, "model.name=tiny-llama-0") as mine:  # a model no heads are shipped for
        pipe = mtp_pipeline(mine)
        assert pipe.strategy_name == "mtp -> suffix_cache"
        assert pipe(prompt_ids=PROMPTS[2]).token_ids == hf_greedy(tiny.model, PROMPTS[2], 24)
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mtpflow: the tuning profile chose")]
    assert f"{chosen!r}" in line and why in line and line.endswith("running suffix_cache")


def test_strategy_settings_given_to_mtp_run_its_own_stages_with_them(tiny, engine, tmp_path, capsys):
    """``strategy.*=`` settings of mtp are settings of its own stages (suffix_cache's): they run, with them, and where
    the profile chose another candidate, one line says so."""
    path = profile_with_choice(tmp_path / "p.json", engine, "pld")
    with engine_on(tiny, path) as mine:
        pipe = mtp_pipeline(mine, "strategy.propose.min_match=3")
        assert pipe.strategy_name == "mtp -> suffix_cache" and pipe.cfg.strategy.propose.min_match == 3
        assert pipe.cfg.strategy.chosen_by == "overrides"
        assert pipe(prompt_ids=PROMPTS[1]).token_ids == hf_greedy(tiny.model, PROMPTS[1], 24)
        assert mtp_pipeline(mine).strategy_name == "mtp -> pld"  # without settings: the measured choice
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "strategy.* settings" in x]
    assert "runs suffix_cache with them, not the measured choice 'pld'" in line


def test_a_malformed_choice_makes_the_profile_damaged(tmp_path):
    data = json.loads(FIXTURE.read_text())
    data["entries"]["default"]["choice"] = {"mtp": {"chosen": 5}}
    assert "choice" in host.profile_problem(data)
    data["entries"]["default"]["choice"] = {"mtp": {"chosen": "pld", "tokens_per_second": {"pld": 9.0}}}
    assert host.profile_problem(data) is None


def test_an_engine_request_for_mtp_resolves_the_same_way_and_the_trace_names_it(tiny, engine, tmp_path):
    from mtpflow.request import Request
    from mtpflow.traces import TraceStore

    db = tmp_path / "t.db"
    path = profile_with_choice(tmp_path / "p.json", engine, "pld")
    cfg = compose(["strategy=baseline", f"trace.db={db}", f"profile={path}", "max_new_tokens=16"])
    with Engine(cfg, loaded=tiny, run_plugins=default_run_plugins(cfg)) as mine:
        result = mine.generate(Request(prompt_ids=PROMPTS[0], strategy="mtp"))
    assert result.stats["strategy"] == "mtp -> pld"
    assert result.token_ids == hf_greedy(tiny.model, PROMPTS[0], 16)
    run = TraceStore(db).get_run(result.run_id)
    assert run["strategy"] == "mtp -> pld" and run["config"]["strategy"]["chosen"] == "pld"


def test_tune_measures_the_candidates_stores_the_winner_and_mtp_runs_it(tiny, engine, tmp_path):
    """The tuner on the tiny model: every runnable candidate timed (mtp_heads left out: no heads for it), the fastest
    stored under this engine's key; a pipeline on the profile runs it."""
    from mtpflow.tools.tune_choice import format_choice, measure_choice

    path = profile_with_choice(tmp_path / "p.json", engine, "pld")
    cfg = compose(["strategy=mtp", f"profile={path}", "trace=off", "model.name=tiny-llama-0"])
    with engine_on(tiny, path, "model.name=tiny-llama-0") as mine:
        result = measure_choice(mine, cfg, prompts=["the quick brown fox", "def add(a, b):"], max_new_tokens=12,
                                repeats=2)
        assert mtp_pipeline(mine).strategy_name == f"mtp -> {result['chosen']}"  # a new pipeline reads it
    stored = json.loads(path.read_text())["entries"][choice_key(engine.backend, engine.loaded)]["choice"]["mtp"]
    # int8_draft where the native kernels run (the engine's backend is native_cpu there), else left out
    native = kernel.available()
    assert set(stored["tokens_per_second"]) == {"suffix_cache", "pld", "recycling", "baseline"} | (
        {"int8_draft"} if native else set())
    assert native or "native CPU kernels" in stored["left_out"]["int8_draft"]
    assert all(v > 0 for v in stored["tokens_per_second"].values())
    speed = stored["tokens_per_second"]
    fastest = max(speed, key=speed.get)
    assert stored["chosen"] == (fastest if speed[fastest] > speed["suffix_cache"] * (1 + stored["margin"])
                                else "suffix_cache")
    assert "no trained medusa heads" in stored["left_out"]["mtp_heads"]
    assert stored["prompts"] == 2 and stored["repeats"] == 2 and result["chosen"] == stored["chosen"]
    assert f"mtp -> {stored['chosen']}" in format_choice(result)


def test_the_cli_names_the_choice_tune_stored(tmp_path):
    """``python -m mtpflow.tune strategy=mtp`` then ``python -m mtpflow strategy=mtp``: the stats line and the JSON
    document name what runs."""
    folder = save_tiny_model(tmp_path / "model")
    path = tmp_path / "tuned.json"
    common = [f"model.name={folder}", f"profile={path}", "trace=off", "strategy=mtp"]

    def run(module, *args):
        out = subprocess.run([sys.executable, "-m", module, *common, *args], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return out

    tuned = run("mtpflow.tune")
    chosen = json.loads(path.read_text())  # the one entry with a choice
    (choice,) = [e["choice"]["mtp"] for e in chosen["entries"].values() if "choice" in e]
    assert f"mtpflow.tune: mtp -> {choice['chosen']}" in tuned.stdout
    text = run("mtpflow", "prompt=the quick brown fox", "max_new_tokens=6")
    assert f"[mtp -> {choice['chosen']} on {folder}]" in text.stdout and NOTICE_START not in text.stderr
    doc = json.loads(run("mtpflow", "prompt=the quick brown fox", "max_new_tokens=6", "output=json").stdout)
    assert doc["strategy"] == doc["stats"]["strategy"] == f"mtp -> {choice['chosen']}"
