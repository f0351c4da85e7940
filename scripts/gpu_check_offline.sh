#!/usr/bin/env bash
# The kernel GPU check for a CUDA machine WITHOUT network (e.g. the H200 device machines): nothing is fetched.
#   - missing pure-python dependencies come as wheels in .whl/ (hydra-core, omegaconf, antlr4-python3-runtime
#     4.9.3; fetch them where pip works, see docs/kernels_gpu_results.md) and are installed into /tmp/site;
#   - mtpflow is imported from the source tree (everything lives under mtpflow/): no pip install of the package;
#   - the decode comparison uses a RANDOMLY initialised model of SmolLM2-135M's shape (the embedded GGUF
#     default model is too big to carry), see scripts/gpu_decode_random.py.
# Steps: kernel tests compiled on CUDA, scripts/kernel_timings.py, the random-model decode comparison.
# Everything lands in $OUT (default gpu-check/): log-*.txt, kernel_timings.md, decode_random.md.
#   OUT=/tmp/x bash scripts/gpu_check_offline.sh
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
timeout ${TIMING_TIMEOUT:-60} $PY scripts/kernel_timings.py --repeats ${REPEATS:-30} --out "$OUT/kernel_timings.md" 2>&1 \
  | tee "$OUT/log-kernel-timings.txt"

echo "== decode comparison (random model of SmolLM2-135M's shape)"
timeout ${DECODE_TIMEOUT:-240} $PY scripts/gpu_decode_random.py --max-new ${MAX_NEW:-128} --repeats ${DECODE_REPEATS:-3} \
  --out "$OUT/decode_random.md" 2>&1 | tee "$OUT/log-decode.txt"
echo "== done"
