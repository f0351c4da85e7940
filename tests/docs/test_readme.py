"""The README is the front door: short, its relative links and pictures exist (mkdocs checks the docs/ pages,
not the README), its strategies table lists every built-in strategy, and its benchmark command only names
real strategies."""
from __future__ import annotations

import re
from pathlib import Path

from mtpflow.conf import conf_dir

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_short():
    assert len(README.splitlines()) < 250


def test_readme_links_and_pictures_exist():
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local, "the README links into docs/"
    for target in local:
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(encoding="utf-8"), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, target


def test_readme_strategies_table_lists_every_builtin_strategy():
    rows = set(re.findall(r"^\| `(\w+)` \|", README, re.M))
    builtin = {p.stem for p in (conf_dir() / "strategy").glob("*.yaml")}
    assert builtin <= rows, builtin - rows


def test_readme_benchmark_command_names_real_strategies():
    (command,) = re.findall(r"^python -m mtpflow\.bench .*$", README, re.M)
    (names,) = re.findall(r"strategies=\[([\w,]+)\]", command)
    builtin = {p.stem for p in (conf_dir() / "strategy").glob("*.yaml")}
    assert set(names.split(",")) <= builtin
