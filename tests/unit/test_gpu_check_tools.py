"""The GPU check's tools on the CPU: ``mtpflow.tools.kernel_timings`` times every kernel's reference and writes
its table, ``mtpflow.tools.random_model_decode`` decodes a tiny random model with the same tokens as HF
``generate``, and ``scripts/gpu_check.sh`` parses and names only tools that exist."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from mtpflow.tools import kernel_timings, random_model_decode

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the tool times the Triton kernels too")
def test_kernel_timings_writes_one_row_per_kernel(tmp_path):
    out = tmp_path / "timings.md"
    text = kernel_timings.main(["--repeats", "1", "--vocab", "64", "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "n/a (no CUDA)" in line]
    assert out.read_text() == text and len(rows) == len(kernel_timings.cases(torch.device("cpu"), 64))
    assert all(float(row.split("|")[3]) >= 0 for row in rows)


def test_random_model_decode_matches_hf_generate(tmp_path):
    out = tmp_path / "decode.md"
    rows = random_model_decode.main(["--tiny", "--settings", "torch-sdpa", "--strategies", "baseline,pld",
                                     "--max-new", "12", "--repeats", "1", "--out", str(out)])
    assert [r["strategy"] for r in rows] == ["baseline", "pld"]
    assert all(r["same_hf"] and r["same_first"] and r["stable"] for r in rows)
    assert out.read_text().count("| kernels=torch, attn=sdpa |") == 2


def test_gpu_check_script_parses_and_names_existing_tools():
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    tools = set(re.findall(r"-m (mtpflow\.tools\.\w+)", script.read_text()))
    assert tools == {"mtpflow.tools.kernel_timings", "mtpflow.tools.random_model_decode"}
    for tool in tools:
        assert (ROOT / (tool.replace(".", "/") + ".py")).exists(), tool
