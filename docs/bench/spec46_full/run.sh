#!/usr/bin/env bash
# Issue #46's must-hold measurement, one run on one host: the bench's 32 prompts and Spec-Bench's questions
# (first turn, every category), first-time requests, 128 new tokens, greedy, the host's 2 threads.
#   part 1: the bench's 32 prompts. HF generate (float32) as the reference; over the float32 target baseline, pld,
#           suffix_cache, mtp_heads, mtp, int8_draft; over the int8 target (model.quantize=int8) the same and
#           recycling, each checked against the int8 reference's greedy; llama.cpp greedy on the Q8_0 GGUF of the
#           same model (its prompt-lookup and batch-16 runs come with it).
#   part 2: the same over Spec-Bench's question.jsonl, SPECBENCH_LIMIT questions of each category.
#   part 3: batch 16, one engine over the 32 prompts, the int8 target (baseline, pld, mtp; with and without the
#           batch-aware K) against HF generate batched and vLLM's CPU build at batch 16 on the same prompt ids.
# Outputs (CSVs, PNGs, manifest.json, peer logs, a log per part) go under docs/bench/spec46_full/<part>/.
# Run the whole script on a quiet machine (here: /work/tools/cpu-exclusive docs/bench/spec46_full/run.sh).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
HERE=$ROOT/docs/bench/spec46_full
cd "$ROOT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}        # this checkout's mtpflow, whatever the venv installed
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x /work/main/.venv/bin/python ]]; then PYTHON=/work/main/.venv/bin/python; else PYTHON=python; fi
fi
export MTPFLOW_LLAMACPP_PYTHON=${MTPFLOW_LLAMACPP_PYTHON:-/root/peers/llamacpp/bin/python}
export MTPFLOW_VLLM_PYTHON=${MTPFLOW_VLLM_PYTHON:-/root/peers/vllm/bin/python}
Q8_GGUF=${Q8_GGUF:-/root/peers/gguf/SmolLM2-135M-Instruct.Q8_0.gguf}      # llama.cpp's Q8_0 of the default model
SPECBENCH=${SPECBENCH:-/root/peers/specbench/question.jsonl}               # Spec-Bench's file, as it ships
SPECBENCH_LIMIT=${SPECBENCH_LIMIT:-4}                                      # questions per category
BENCH_LIMIT=${BENCH_LIMIT:-0}          # prompts per class of the bench's suite: 0 = all 32 (>0 only to smoke-test)
NEW=${NEW:-128}                        # new tokens (128 in the measurement; fewer only to smoke-test)
OUT=${OUT:-$HERE}                      # where the parts' folders go

for f in "$Q8_GGUF" "$SPECBENCH" "$MTPFLOW_LLAMACPP_PYTHON" "$MTPFLOW_VLLM_PYTHON"; do
    [[ -e "$f" ]] || { echo "run.sh: missing $f (see docs/bench/spec46_full/README.md)" >&2; exit 2; }
done
for part in bench32 specbench batch16; do
    if [[ -e "$OUT/$part" ]]; then echo "run.sh: $OUT/$part exists; move it away first" >&2; exit 2; fi
done

Q=model.quantize=int8
STRATEGIES="strategies=[baseline,pld,suffix_cache,mtp_heads,mtp,int8_draft,\
'baseline|$Q','pld|$Q','suffix_cache|$Q','mtp_heads|$Q','mtp|$Q','recycling|$Q','int8_draft|$Q']"

stamp() { echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) $*"; }

stamp "start: $(git -C "$ROOT" rev-parse --short HEAD), $(lscpu | sed -n 's/^Model name: *//p'), python $PYTHON"

stamp "part 1/3: the bench's 32 prompts, float32 + int8 strategies, llama.cpp Q8_0"
mkdir -p "$OUT/bench32"
"$PYTHON" -m mtpflow.bench limit=$BENCH_LIMIT "$STRATEGIES" "peers=[llamacpp]" "peer_gguf=$Q8_GGUF" \
    max_new_tokens=$NEW "overrides=[trace=off]" out="$OUT/bench32" 2>&1 | tee "$OUT/bench32/run.log"

stamp "part 2/3: Spec-Bench, first turn, limit=$SPECBENCH_LIMIT per category, float32 + int8 strategies, llama.cpp Q8_0"
mkdir -p "$OUT/specbench"
"$PYTHON" -m mtpflow.bench "prompts=$SPECBENCH" limit=$SPECBENCH_LIMIT turns=1 "$STRATEGIES" "peers=[llamacpp]" \
    "peer_gguf=$Q8_GGUF" max_new_tokens=$NEW "overrides=[trace=off]" out="$OUT/specbench" \
    2>&1 | tee "$OUT/specbench/run.log"

stamp "part 3/3: batch 16, the 32 prompts, int8 engine vs HF batched and vLLM's CPU build"
mkdir -p "$OUT/batch16"
"$PYTHON" -m mtpflow.bench mode=batch limit=$BENCH_LIMIT "strategies=[baseline,pld,mtp]" "batch_sizes=[16]" \
    "batch_k=[off,auto]" "peers=[vllm]" max_new_tokens=$NEW "overrides=[trace=off,$Q]" out="$OUT/batch16" \
    2>&1 | tee "$OUT/batch16/run.log"

stamp "done"
