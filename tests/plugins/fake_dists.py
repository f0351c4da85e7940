"""Fake installed distributions for plugin tests: a module tree plus a ``*.dist-info`` folder with an
``entry_points.txt`` in a temporary folder put on ``sys.path``, which ``importlib.metadata`` finds like a
real installation."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from mtpflow.plugins import entry_points

GOOD_STRATEGY = """\
name: {name}
description: a fake plugin strategy
lossless: true
select_k: {{_target_: mtpflow.strategies.k_selectors.FixedK, k: 4}}
propose: {{_target_: {propose}}}
prune: []
gate: {{_target_: mtpflow.strategies.gates.GreedyGate}}
dedup: []
rescore: null
window: null
plugins: {plugins}
"""

STRATEGY_DIRS_HOOK = """\
from pathlib import Path
from mtpflow.plugins import hookimpl

@hookimpl
def mtpflow_strategy_dirs():
    return [Path(__file__).parent / "conf" / "strategy"]
"""


def install_fake(root: Path, dist: str, package: str, files: dict[str, str], entry_point: str | None = None,
                 name: str | None = None) -> None:
    """Write ``files`` (paths relative to the package folder) and a dist-info declaring the entry point
    ``name = entry_point`` (default: the package) in group mtpflow."""
    for rel, text in files.items():
        path = root / package / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[mtpflow]\n{name or package} = {entry_point or package}\n")
    (info / "top_level.txt").write_text(f"{package}\n")
    importlib.invalidate_caches()


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A folder on sys.path for fake distributions; plugin caches and imported fake modules are reset."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(entry_points.SELECT_ENV, raising=False)
    before = set(sys.modules)
    entry_points.clear_cache()
    yield site
    entry_points.clear_cache()
    for mod in set(sys.modules) - before:
        if mod.startswith("fakeplug"):
            del sys.modules[mod]


def stage_module(body: str) -> str:
    # the stable import path that plugins written before mtpflow.plugins use (STRATEGY_DIRS_HOOK uses the new one)
    return "import torch\nfrom mtpflow.hookspecs import hookimpl\nfrom mtpflow.types import Draft\n\n" + body
