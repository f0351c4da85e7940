"""Every result table in the README and the docs is generated from the run it names (``<!-- table:KIND
source=CSV manifest=JSON -->``): each matches what its CSV and manifest give, an edited cell or an edited CSV
fails the check, and docs/bench/README.md is the index of the manifests in docs/bench."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mtpflow.tools import tables

ROOT = Path(__file__).resolve().parents[2]
RUN = "docs/bench/all20_dec04_zen4"


def test_every_marked_table_matches_its_run():
    stale = tables.regenerate(ROOT, write=False)
    assert stale == [], f"run `python -m mtpflow.tools.tables` to regenerate: {stale}"
    marked = {p.relative_to(ROOT).as_posix() for p in tables.marked_files(ROOT)}
    assert {"README.md", "docs/strategies.md"} <= marked


def test_the_readme_shows_one_run_on_one_host():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Strategies", 1)[1].split("\n## ", 1)[0]
    markers = tables.MARKER.findall(section)
    assert len(markers) == 1
    assert f"source={RUN}_summary.csv manifest={RUN}_manifest.json" in markers[0][1]
    assert "Host: AMD EPYC (2 cores, AVX-512 + VNNI); 2026-12-04; commit c45bf50" in section


def copy_checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "docs" / "bench").mkdir(parents=True)
    for rel in ("README.md", "docs/strategies.md", "docs/bench/lab-log.md"):
        shutil.copyfile(ROOT / rel, root / rel)
    for path in (ROOT / "docs" / "bench").glob("*_manifest.json"):
        name = path.name[: -len("_manifest.json")]
        for one in (ROOT / "docs" / "bench").glob(f"{name}_*"):
            shutil.copyfile(one, root / "docs" / "bench" / one.name)
    return root


def test_regenerated_copy_passes_and_an_edited_cell_fails(tmp_path, capsys):
    root = copy_checkout(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text(encoding="utf-8").replace("| 4.32x |", "| 4.33x |"), encoding="utf-8")
    assert tables.main(["--check", "--root", str(root)]) == 1
    assert "stale: README.md: table:strategies" in capsys.readouterr().out
    assert tables.main(["--root", str(root)]) == 0  # regenerate into the copy: the check passes again
    assert tables.main(["--check", "--root", str(root)]) == 0
    assert readme.read_text(encoding="utf-8") == (ROOT / "README.md").read_text(encoding="utf-8")
    # one cell of the per-class table, then a row dropped
    page = root / "docs" / "strategies.md"
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace("| 4.66x / 6.08 |", "| 4.66x / 6.18 |"), encoding="utf-8")
    assert tables.regenerate(root, write=False) == [f"docs/strategies.md: table:classes from {RUN}_summary.csv"]
    page.write_text("\n".join(line for line in text.splitlines() if not line.startswith("| `eagle3` |")) + "\n",
                    encoding="utf-8")
    assert len(tables.regenerate(root, write=False)) == 1


def test_a_csv_edited_after_its_run_is_refused(tmp_path, capsys):
    root = copy_checkout(tmp_path)
    csv = root / f"{RUN}_summary.csv"
    csv.write_text(csv.read_text(encoding="utf-8").replace("int8_draft,overall,32,2566,72.31,4.323",
                                                           "int8_draft,overall,32,2566,72.31,4.423"), encoding="utf-8")
    assert tables.main(["--check", "--root", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"mtpflow.tools.tables: error: {RUN}_summary.csv is not a file its manifest {RUN}_manifest.json "
                   "recorded (edited after the run?)")


def test_point_at_another_run_and_publish(tmp_path, capsys):
    """``--publish`` copies a bench run into docs/bench (files renamed, manifest updated); ``--summary`` and
    ``--manifest`` point the README's and the strategies page's tables at it; the index lists it."""
    root = copy_checkout(tmp_path)
    run = tmp_path / "bench-results"
    run.mkdir()
    bench = ROOT / "docs" / "bench"
    shutil.copyfile(bench / "all20_dec04_xeon_summary.csv", run / "bench_summary.csv")
    shutil.copyfile(bench / "all20_dec04_xeon_runs.csv", run / "bench_runs.csv")
    record = json.loads((bench / "all20_dec04_xeon_manifest.json").read_text())
    record.pop("reconstructed")
    record["date"] = "2026-12-05T10:00:00+00:00"
    record["files"] = {name: record["files"][f"all20_dec04_xeon_{name.split('_', 1)[1]}"]
                       for name in ("bench_summary.csv", "bench_runs.csv")}
    (run / "manifest.json").write_text(json.dumps(record))
    assert tables.main(["--root", str(root), "--publish", str(run), "again"]) == 0
    assert (root / "docs/bench/again_summary.csv").is_file()
    assert set(json.loads((root / "docs/bench/again_manifest.json").read_text())["files"]) == {
        "again_summary.csv", "again_runs.csv"}
    assert tables.main(["--root", str(root), "--summary", "docs/bench/again_summary.csv", "--manifest",
                        "docs/bench/again_manifest.json"]) == 0
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert "source=docs/bench/again_summary.csv manifest=docs/bench/again_manifest.json" in readme
    body = tables.MARKER.search(readme).group("body")
    assert "2026-12-05" in body and "reconstructed" not in body
    assert "`again`" in (root / "docs/bench/README.md").read_text(encoding="utf-8")
    assert tables.main(["--check", "--root", str(root)]) == 0
    # a second publish under the same name would overwrite a committed run
    assert tables.main(["--root", str(root), "--publish", str(run), "again"]) == 2
    assert "docs/bench/again_summary.csv exists" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--summary", "docs/bench/nothing.csv", "--manifest", "docs/bench/nothing.json"], "no such file"),
    (["--summary", "docs/bench/all20_dec04_xeon_summary.csv"], "--summary and --manifest go together"),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, args, message):
    root = copy_checkout(tmp_path)
    assert tables.main(["--root", str(root), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
