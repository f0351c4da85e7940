"""The house rules that code can check: the inference path (engine, loop, API, CLI, every built-in stage)
never imports training, data-building or benchmark code."""
from __future__ import annotations

import subprocess
import sys

TOOLS = ("mtpflow.train_heads", "mtpflow.head_data", "mtpflow.train_domain", "mtpflow.domain_prompts",
         "mtpflow.bench", "mtpflow.bench_batch", "mtpflow.traces.overhead")


def test_inference_path_imports_no_training_or_bench_code():
    code = (
        "import importlib, pkgutil, sys\n"
        "import mtpflow.engine, mtpflow.api, mtpflow.cli, mtpflow.strategies\n"
        "for m in pkgutil.iter_modules(mtpflow.strategies.__path__):\n"
        "    importlib.import_module('mtpflow.strategies.' + m.name)\n"
        f"print(sorted(m for m in sys.modules if m in {TOOLS!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
