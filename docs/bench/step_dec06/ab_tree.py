"""In-process A/B of whole native source trees (every .c and .h of mtpflow/backends/native, not one file): each
named tree is built into its own library and timed against the others by ab_kv.compare (alternating rounds, 20
verify forwards per draft length over a prefilled int8 cache). Prints each build's fastest and median ms and, per
K, the median over the rounds of each tree over the first.

    python docs/bench/step_dec06/ab_tree.py ROUNDS CONTEXT K,K,... NAME=REV NAME=REV ...

REV is a commit, or ``work`` for the working tree.
"""
import io
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "int8_kv_dec06"))
import ab_kv  # noqa: E402

from mtpflow.backends.native import kernel  # noqa: E402


def source_tree(rev: str, into: Path) -> Path:
    """The native sources of ``rev`` (or the working tree's) copied under ``into``; returns their folder."""
    if rev == "work":
        shutil.copytree(kernel.HERE, into / "native")
        return into / "native"
    data = subprocess.run(["git", "archive", rev, "mtpflow/backends/native"], capture_output=True, check=True,
                          cwd=kernel.HERE.parents[2]).stdout
    tarfile.open(fileobj=io.BytesIO(data)).extractall(into)
    return into / "mtpflow" / "backends" / "native"


def main(rounds: int, context: int, ks: list[int], specs: dict[str, str], backend=None, timed: int = 20) -> None:
    """``specs`` (name -> REV) timed against each other by ab_kv.compare over ``backend``'s int8 model (default: the
    default model), ``timed`` verify forwards per draft length and round; prints each K's median ratio to the first."""
    root = Path(tempfile.mkdtemp())
    folders = {name: source_tree(rev, root / name) for name, rev in specs.items()}

    def build(folder: Path, name: str, _source: str):
        out = folder / name / "kernel.so"
        if not kernel.build(kernel.compiler(), out, kernel.FLAGS, tuple(folders[name] / p.name for p in kernel.SOURCES)):
            sys.exit(f"the {name} build failed")
        return kernel.load(out)

    ab_kv.build = build  # compare() builds each name through it
    times = ab_kv.compare({name: "" for name in specs}, context, ks, rounds, backend=backend, timed=timed)
    first = next(iter(specs))
    for k in ks:
        print(f"K={k}: " + ", ".join(
            f"{name} / {first} {statistics.median(b / a for a, b in zip(times[(first, k)], times[(name, k)])):.3f}"
            for name in specs if name != first))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]), int(args[1]), [int(x) for x in args[2].split(",")], dict(a.split("=", 1) for a in args[3:]))
