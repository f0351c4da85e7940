"""The house rules that code can check: the inference path (engine, loop, API, CLI, every built-in stage)
never imports training, data-building or benchmark code; no folder of the checkout shadows another package."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mtpflow

COMMANDS = ("bench", "train_heads", "train_domain")  # python -m mtpflow.<name>: entry points into mtpflow.tools


def test_inference_path_imports_no_training_or_bench_code():
    code = (
        "import importlib, pkgutil, sys\n"
        "import mtpflow.engine, mtpflow.api, mtpflow.cli, mtpflow.serve.app, mtpflow.strategies\n"
        "for m in pkgutil.iter_modules(mtpflow.strategies.__path__):\n"
        "    importlib.import_module('mtpflow.strategies.' + m.name)\n"
        f"print(sorted(m for m in sys.modules if m.startswith('mtpflow.tools') or m in "
        f"{tuple('mtpflow.' + c for c in COMMANDS)!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_tools_live_in_their_own_subpackage():
    """Benchmarks, training and data building live in ``mtpflow.tools``; the short command modules only
    forward to it (no code of their own to drift)."""
    root = Path(mtpflow.__file__).parent
    for name in COMMANDS:
        code = [line for line in (root / f"{name}.py").read_text().splitlines()
                if line.strip() and not line.startswith(('"""', "import sys", "if __name__", "    sys.exit"))]
        assert code == [f"from mtpflow.tools.{name} import main"], (name, code)
        assert (root / "tools" / f"{name}.py").exists()
    top_level = {p.stem for p in root.glob("*.py")}
    assert not top_level & {"bench_batch", "bench_serve", "head_data", "domain_prompts"}


def test_no_top_level_folder_of_the_checkout_is_a_python_package():
    """``python -m ...`` run from the checkout puts it first on ``sys.path``: a top-level ``kernels/`` with an
    ``__init__.py`` was imported in place of the PyPI ``kernels`` that transformers (5.25) imports at start, and
    every model load failed. mtpflow's own packages live under ``mtpflow/``; plugins and tests have their own."""
    checkout = Path(mtpflow.__file__).resolve().parent.parent
    packages = sorted(p.parent.name for p in checkout.glob("*/__init__.py"))
    assert packages == ["mtpflow"], packages


def test_transformers_imports_from_the_checkout_as_working_directory():
    checkout = Path(mtpflow.__file__).resolve().parent.parent
    code = "import transformers.activations, mtpflow.kernels; print(mtpflow.kernels.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "mtpflow.kernels"
