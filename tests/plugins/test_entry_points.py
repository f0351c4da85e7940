"""Third-party plugins through entry points, with fake distributions: loading and MTPFLOW_LOAD_PLUGINS,
strategies found by Hydra, stage hooks only where a strategy asks, and broken plugins (import error, a hook
that raises, a misspelled hook) reported in one line naming the plugin while other strategies keep working."""
from __future__ import annotations

import logging

import pytest

from helpers import hf_greedy, make_pipeline
from fake_dists import GOOD_STRATEGY, STRATEGY_DIRS_HOOK, fake_site, install_fake, stage_module  # noqa: F401
from mtpflow import cli
from mtpflow.plugins import entry_points
from mtpflow.config import available_strategies, compose
from mtpflow.errors import PluginError, UserError

COPY_PROPOSER = stage_module("""
class RepeatLastProposer:
    '''Drafts the last token K times: often wrong, so the gate must reject.'''
    @hookimpl
    def propose(self, state, k):
        return Draft.chain([state.root_token] * k, source="repeat_last")
""")

PROMPT = [5, 9, 17, 5, 9, 17, 5, 9]


def fakes():
    """The fake plugins of this test (really installed ones, such as the example, may load too)."""
    return [p for p in entry_points.third_party_plugins() if p.name.startswith("fakeplug")]


def good_plugin(site, package="fakeplug_good", strategy="fakestrat", plugins="[]", extra_init=""):
    install_fake(site, package.replace("_", "-"), package, {
        "__init__.py": STRATEGY_DIRS_HOOK + extra_init,
        "stages.py": COPY_PROPOSER,
        f"conf/strategy/{strategy}.yaml": GOOD_STRATEGY.format(
            name=strategy, propose=f"{package}.stages.RepeatLastProposer", plugins=plugins),
    })


def test_installed_plugin_adds_a_strategy_that_runs_losslessly(fake_site, tiny):
    good_plugin(fake_site)
    (plugin,) = fakes()
    assert (plugin.name, plugin.error, plugin.strategies) == ("fakeplug_good", None, ("fakestrat",))
    assert "fakestrat" in available_strategies()
    cfg = compose(["strategy=fakestrat"])  # Hydra resolves it through the plugin's search path entry
    assert cfg.strategy.propose._target_ == "fakeplug_good.stages.RepeatLastProposer"
    result = make_pipeline(tiny, "fakestrat", "max_new_tokens=24")(prompt_ids=PROMPT)
    assert result.token_ids == hf_greedy(tiny.model, PROMPT, 24)
    assert "repeat_last" in {r.draft.source for r in result.steps}


@pytest.mark.parametrize("selection, loaded", [(None, True), ("", False), ("  ", False), ("other", False),
                                               ("other, fakeplug_good", True)])
def test_load_plugins_variable(fake_site, monkeypatch, selection, loaded):
    good_plugin(fake_site)
    if selection is not None:
        monkeypatch.setenv(entry_points.SELECT_ENV, selection)
    assert ("fakestrat" in available_strategies()) is loaded
    (plugin,) = fakes()
    assert plugin.selected is loaded
    if not loaded:
        with pytest.raises(UserError, match="MTPFLOW_LOAD_PLUGINS does not load fakeplug_good"):
            compose(["strategy=fakestrat"])


def test_load_plugins_names_a_missing_plugin(fake_site, monkeypatch, caplog):
    monkeypatch.setenv(entry_points.SELECT_ENV, "nosuchplugin")
    with caplog.at_level(logging.WARNING, "mtpflow.plugins"):
        entry_points.third_party_plugins()
    assert "'nosuchplugin', but no installed distribution declares it" in caplog.text


def test_import_error_is_one_line_and_pld_keeps_working(fake_site, tiny, caplog):
    good_plugin(fake_site)
    install_fake(fake_site, "fakeplug-broken", "fakeplug_broken",
                 {"__init__.py": "import no_such_module_for_mtpflow_tests\n"})
    with caplog.at_level(logging.WARNING, "mtpflow.plugins"):
        found = {p.name: p for p in fakes()}
    assert found["fakeplug_broken"].error == (
        "cannot import fakeplug_broken: ModuleNotFoundError: No module named 'no_such_module_for_mtpflow_tests'")
    assert "plugin 'fakeplug_broken' (fakeplug-broken 0.1) skipped: cannot import" in caplog.text
    assert found["fakeplug_good"].error is None  # one broken plugin does not take the others down
    ids = [3, 4, 5, 3, 4, 5]
    assert make_pipeline(tiny, "pld", "max_new_tokens=8")(prompt_ids=ids).token_ids == hf_greedy(tiny.model, ids, 8)
    with pytest.raises(UserError, match=r"unknown strategy 'nope'.*plugin 'fakeplug_broken' .* is broken: "
                                         r"cannot import"):
        compose(["strategy=nope"])


def test_hook_that_raises_names_the_plugin(fake_site, tiny):
    raising_plugin(fake_site)
    pipe = make_pipeline(tiny, "raises", "max_new_tokens=8")
    with pytest.raises(PluginError) as info:
        pipe(prompt_ids=PROMPT)
    message = str(info.value)
    assert message == ("plugin 'fakeplug_raises' (fakeplug-raises 0.1), fakeplug_raises.stages.FailingProposer: "
                       "hook propose raised ZeroDivisionError: division by zero")
    assert isinstance(info.value.__cause__, ZeroDivisionError)  # the traceback stays reachable for debugging
    # the same pipeline's model runs other strategies fine
    assert make_pipeline(tiny, "pld", "max_new_tokens=8")(prompt_ids=PROMPT).token_ids == hf_greedy(tiny.model, PROMPT, 8)


def raising_plugin(site):
    install_fake(site, "fakeplug-raises", "fakeplug_raises", {
        "__init__.py": STRATEGY_DIRS_HOOK,
        "stages.py": stage_module("""
class FailingProposer:
    @hookimpl
    def propose(self, state, k):
        return 1 / 0
"""),
        "conf/strategy/raises.yaml": GOOD_STRATEGY.format(name="raises", propose="fakeplug_raises.stages.FailingProposer",
                                                          plugins="[]"),
    })


@pytest.mark.default_model
def test_cli_hook_that_raises_exits_2_with_one_line(fake_site, capsys):
    raising_plugin(fake_site)
    assert cli.main(["strategy=raises", "prompt=Say hi", "max_new_tokens=8", "trace=off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mtpflow: error: plugin 'fakeplug_raises' (fakeplug-raises 0.1), "
                   "fakeplug_raises.stages.FailingProposer: hook propose raised ZeroDivisionError: division by zero"]


def test_misspelled_hook_in_entry_point_module(fake_site):
    install_fake(fake_site, "fakeplug-typo", "fakeplug_typo", {"__init__.py": STRATEGY_DIRS_HOOK.replace(
        "def mtpflow_strategy_dirs", "def mtpflow_strategy_dir")})
    (plugin,) = fakes()
    assert plugin.error == ("fakeplug_typo implements unknown hook 'mtpflow_strategy_dir' "
                            "(did you mean 'mtpflow_strategy_dirs'?)")
    assert plugin.obj is None


def test_misspelled_hook_in_stage_class(fake_site, tiny):
    install_fake(fake_site, "fakeplug-stagetypo", "fakeplug_stagetypo", {
        "__init__.py": STRATEGY_DIRS_HOOK,
        "stages.py": stage_module("""
class TypoProposer:
    @hookimpl
    def propse(self, state, k):
        return Draft.empty()
"""),
        "conf/strategy/typo.yaml": GOOD_STRATEGY.format(name="typo", propose="fakeplug_stagetypo.stages.TypoProposer",
                                                        plugins="[]"),
    })
    pipe = make_pipeline(tiny, "typo", "max_new_tokens=8")
    with pytest.raises(PluginError, match=r"^plugin 'fakeplug_stagetypo' \(fakeplug-stagetypo 0.1\), strategy.propose "
                                          r"\(fakeplug_stagetypo.stages.TypoProposer\) implements unknown hook "
                                          r"'propse' \(did you mean 'propose'\?\)$"):
        pipe(prompt_ids=PROMPT)


@pytest.mark.parametrize("init, problem", [
    (STRATEGY_DIRS_HOOK.replace("return [", "raise RuntimeError('no conf'); return ["),
     "hook mtpflow_strategy_dirs raised RuntimeError: no conf"),
    (STRATEGY_DIRS_HOOK.replace('"strategy"', '"strategies"'), "the folder must be named 'strategy'"),
    (STRATEGY_DIRS_HOOK.replace('"strategy"', '"missing"'), "which is not a folder"),
])
def test_bad_strategy_folders(fake_site, init, problem):
    install_fake(fake_site, "fakeplug-dirs", "fakeplug_dirs", {"__init__.py": init, "conf/strategies/x.yaml": "name: x\n",
                                                               "conf/strategy/x.yaml": "name: x\n"})
    (plugin,) = fakes()
    assert problem in plugin.error
    assert "x" not in available_strategies()


def test_plugin_may_not_shadow_a_builtin_strategy(fake_site):
    good_plugin(fake_site, strategy="pld")
    (plugin,) = fakes()
    assert plugin.error == "ships strategies that already exist: pld (already from mtpflow)"
    assert compose(["strategy=pld"]).strategy.propose._target_ == "mtpflow.strategies.pld.PromptLookupProposer"


def test_entry_point_stage_hooks_join_only_runs_that_ask(fake_site, tiny):
    counter = """
STEPS = []

@hookimpl
def on_step_end(record):
    STEPS.append(record.step)
"""
    good_plugin(fake_site, plugins="[fakeplug_good]", extra_init=counter)
    module = entry_points.plugin_object("fakeplug_good")
    make_pipeline(tiny, "pld", "max_new_tokens=6")(prompt_ids=PROMPT)
    assert module.STEPS == []  # installed, loaded, but pld does not list it
    result = make_pipeline(tiny, "fakestrat", "max_new_tokens=6")(prompt_ids=PROMPT)
    assert module.STEPS == [r.step for r in result.steps] and module.STEPS
    with pytest.raises(UserError, match="no mtpflow plugin named 'ghost'"):
        make_pipeline(tiny, "pld", "strategy.plugins=[ghost]")


def test_cli_unknown_plugin_strategy_exits_2(fake_site, capsys):
    install_fake(fake_site, "fakeplug-broken", "fakeplug_broken", {"__init__.py": "raise ImportError('boom')\n"})
    assert cli.main(["strategy=theirs", "prompt=hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mtpflow: error: unknown strategy 'theirs'")
    assert "plugin 'fakeplug_broken' (fakeplug-broken 0.1) is broken: cannot import fakeplug_broken: ImportError: boom" in err[-1]
