"""The tutorial page (docs/tutorial.md) as a test, so the page cannot rot: every fenced code block that carries a
file name (```python title="src/mtpflow_bigram/proposer.py"```) is extracted and written into a fresh project
folder, the project is declared installed the way pip would (a ``*.dist-info`` with the page's entry points, read
from the page's own pyproject.toml), and then the page's code runs as the page shows it: the strategy resolves
through the plugin, the page's Python script decodes (on the tiny random model instead of the default model), and
the page's test file passes under pytest."""
from __future__ import annotations

import importlib
import importlib.util
import re
import runpy
import sys
from pathlib import Path

import pytest

from mtpflow.plugins import entry_points
from mtpflow.config import available_strategies, compose

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tutorial.md"
# ```lang title="path"  ...  ``` (the title is what mkdocs-material shows above the block)
FILE_BLOCK = re.compile(r'^```(?P<lang>[\w-]+) +title="(?P<path>[^"]+)"[ \t]*\n(?P<body>.*?)^```[ \t]*$', re.M | re.S)
ANY_BLOCK = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
EXPECTED_FILES = {
    "src/mtpflow_bigram/proposer.py",
    "src/mtpflow_bigram/conf/strategy/bigram.yaml",
    "src/mtpflow_bigram/__init__.py",
    "pyproject.toml",
    "run_bigram.py",
    "tests/test_bigram.py",
}


def page_files() -> dict[str, str]:
    files: dict[str, str] = {}
    for m in FILE_BLOCK.finditer(PAGE.read_text(encoding="utf-8")):
        assert m["path"] not in files, f"{m['path']} appears twice on the tutorial page"
        files[m["path"]] = m["body"]
    return files


def bash_blocks() -> list[str]:
    return [m["body"] for m in ANY_BLOCK.finditer(PAGE.read_text(encoding="utf-8")) if m["info"].strip() == "bash"]


def fake_install(project: Path, site: Path) -> list[str]:
    """What ``pip install -e .`` leaves behind that mtpflow looks at: a dist-info folder declaring the page's
    entry points. Returns the entry point names of group mtpflow."""
    meta = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = meta["entry-points"]["mtpflow"]
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    (info / "entry_points.txt").write_text(
        "[mtpflow]\n" + "".join(f"{name} = {value}\n" for name, value in declared.items()))
    (info / "top_level.txt").write_text("".join(f"{v.split(':')[0].split('.')[0]}\n" for v in declared.values()))
    importlib.invalidate_caches()
    return list(declared)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The tutorial's project folder, written from the page, importable from src/ and declared installed."""
    root = tmp_path / "mtpflow-bigram"
    for rel, body in page_files().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    site = tmp_path / "site"
    names = fake_install(root, site)
    monkeypatch.syspath_prepend(str(root / "src"))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(entry_points.SELECT_ENV, ",".join(names))
    monkeypatch.chdir(root)
    before = set(sys.modules)
    entry_points.clear_cache()
    yield root
    entry_points.clear_cache()
    for mod in set(sys.modules) - before:
        if mod.split(".")[0] == "mtpflow_bigram":
            del sys.modules[mod]


def test_the_page_shows_every_file_of_the_project():
    assert set(page_files()) == EXPECTED_FILES


def test_the_pages_pyproject_is_valid_and_ships_the_strategy(project):
    read_configuration = pytest.importorskip("setuptools.config.pyprojecttoml").read_configuration

    config = read_configuration(project / "pyproject.toml")  # validates against the pyproject schema
    assert config["project"]["entry-points"]["mtpflow"] == {"bigram": "mtpflow_bigram"}
    package_data = config["tool"]["setuptools"]["package-data"]["mtpflow_bigram"]
    shipped = {p.relative_to(project / "src" / "mtpflow_bigram").as_posix()
               for pattern in package_data for p in (project / "src" / "mtpflow_bigram").glob(pattern)}
    assert shipped == {"conf/strategy/bigram.yaml"}  # the YAML goes into the wheel


def test_the_plugin_loads_and_its_strategy_resolves(project):
    (plugin,) = [p for p in entry_points.third_party_plugins() if p.name == "bigram"]
    assert plugin.error is None, plugin.error
    assert plugin.strategies == ("bigram",)
    assert "mtpflow_strategy_dirs" in plugin.hooks
    assert "bigram" in available_strategies()
    cfg = compose(["strategy=bigram"])
    assert cfg.strategy.propose._target_ == "mtpflow_bigram.proposer.BigramProposer"
    assert cfg.strategy.lossless is True


def test_the_pages_script_runs(project, tiny, monkeypatch, capsys):
    # the page loads the default model; here the same script decodes with the tiny random model of the tests:
    # every module that imported load_model (whichever builds pipelines) gets one that returns it
    import mtpflow.api  # noqa: F401  (imports the modules that load models)
    import mtpflow.model

    real = mtpflow.model.load_model
    for module in [m for m in list(sys.modules.values()) if m is not None]:
        if getattr(module, "load_model", None) is real:
            monkeypatch.setattr(module, "load_model", lambda *args, **kwargs: tiny)
    runpy.run_path(str(project / "run_bigram.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert re.search(r"^MAL \d+\.\d\d, acceptance \d\.\d\d, drafted in \d+ steps$", out, re.M), out


def test_the_pages_tests_pass(project, capsys):
    # `python -m pytest tests` in the project folder, in this process (a second interpreter would spend most
    # of its time importing torch again)
    exit_code = pytest.main(["-q", "-p", "no:cacheprovider", str(project / "tests")])
    out = capsys.readouterr().out
    assert exit_code == 0, out[-4000:]
    assert re.search(r"\b3 passed\b", out), out[-2000:]
    sys.modules.pop("test_bigram", None)


def test_the_pages_commands_name_real_strategies_and_modules(project):
    commands = "\n".join(bash_blocks())
    strategies = set(re.findall(r"\bstrategy=(\w+)", commands))
    assert strategies and strategies <= set(available_strategies()), strategies
    for module in set(re.findall(r"python -m (mtpflow[\w.]*)", commands)):
        assert importlib.util.find_spec(module) is not None, module
