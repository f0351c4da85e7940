#!/usr/bin/env bash
# #46's decode must-holds at this commit, a shorter list than spec46_full/run.sh (its parts 1 and 2; no batch 16):
# the bench's 32 prompts, then Spec-Bench's question.jsonl (first turn, SPECBENCH_LIMIT questions of each of its six
# report categories), first-time requests, 128 new tokens, greedy, one process each with HF generate and llama.cpp's
# greedy on the Q8_0 GGUF. mtp runs the host's measured choice: `python -m mtpflow.tune strategy=mtp` first.
#     docs/bench/step_dec07b/run46.sh OUT
set -euo pipefail
OUT=${1:?usage: run46.sh OUT}
PYTHON=${PYTHON:-python}
export MTPFLOW_LLAMACPP_PYTHON=${MTPFLOW_LLAMACPP_PYTHON:-/root/peers/llamacpp/bin/python}
Q8_GGUF=${Q8_GGUF:-/root/peers/gguf/SmolLM2-135M-Instruct.Q8_0.gguf}
SPECBENCH=${SPECBENCH:-/root/specbench/question.jsonl}
SPECBENCH_LIMIT=${SPECBENCH_LIMIT:-4}
Q=model.quantize=int8
STRATEGIES="strategies=[baseline,int8_draft,mtp,mtp_heads,'baseline|$Q','pld|$Q','suffix_cache|$Q','mtp_heads|$Q']"
mkdir -p "$OUT/bench32" "$OUT/specbench"
date -u
"$PYTHON" -m mtpflow.bench "$STRATEGIES" "peers=[llamacpp]" "peer_gguf=$Q8_GGUF" max_new_tokens=128 \
    "overrides=[trace=off]" out="$OUT/bench32" 2>&1 | tee "$OUT/bench32/run.log"
date -u
"$PYTHON" -m mtpflow.bench "prompts=$SPECBENCH" limit=$SPECBENCH_LIMIT turns=1 "$STRATEGIES" "peers=[llamacpp]" \
    "peer_gguf=$Q8_GGUF" max_new_tokens=128 "overrides=[trace=off]" out="$OUT/specbench" 2>&1 | tee "$OUT/specbench/run.log"
date -u
