"""Seconds from a fresh process's start to its first generated token, by phase, for mtpflow and for
transformers alone (the floor any process that loads the model through transformers pays).

    python scripts/startup_time.py [RUNS] [STRATEGY]     # default 3 runs of each, alternating; strategy mtp

mtpflow: ``from mtpflow import api`` (imports), ``api.pipeline(STRATEGY, ["max_new_tokens=1"])`` (config, model,
tokenizer, plans), one request of one token. transformers: ``import transformers`` + the model class, then
``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` of the same converted default model, then
``generate(max_new_tokens=1)``. The clock starts in this (parent) process just before the child is spawned, so
interpreter start-up counts; the child's exit does not. Both run after the caches are warm (a first mtpflow run
is made and not counted: it may build the native kernels or time the plans), so this is the "second process"
figure. Prints medians per phase.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

MTPFLOW = r"""
import json, sys, time
from mtpflow import api
t_import = time.time()
p = api.pipeline(sys.argv[1], ["max_new_tokens=1", "trace=off"])
t_load = time.time()
p("Write one sentence about the sea.")
print(json.dumps({"imports": t_import, "load": t_load, "first token": time.time()}))
"""

TRANSFORMERS = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import transformers.models.llama.modeling_llama  # what from_pretrained imports for this model
t_import = time.time()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
t_load = time.time()
ids = tok.apply_chat_template([{"role": "user", "content": "Write one sentence about the sea."}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)
model.generate(**ids, max_new_tokens=1, do_sample=False)
print(json.dumps({"imports": t_import, "load": t_load, "first token": time.time()}))
"""


def run(code: str, arg: str) -> dict[str, float]:
    start = time.time()
    done = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "child failed")
    marks = json.loads(done.stdout.strip().splitlines()[-1])
    out, last = {}, start
    for phase, at in marks.items():
        out[phase] = at - last
        last = at
    out["total"] = last - start
    return out


def main(runs: int = 3, strategy: str = "mtp") -> None:
    from mtpflow.model import resolve_source

    source, _ = resolve_source(None, None)
    run(MTPFLOW, strategy)  # warm: builds or times what a first process would, not counted
    results: dict[str, list[dict[str, float]]] = {"mtpflow": [], "transformers": []}
    for _ in range(runs):
        results["mtpflow"].append(run(MTPFLOW, strategy))
        results["transformers"].append(run(TRANSFORMERS, source))
    for name, rs in results.items():
        phases = " + ".join(f"{p} {statistics.median(r[p] for r in rs):.2f}" for p in rs[0] if p != "total")
        totals = sorted(r["total"] for r in rs)
        print(f"{name:12s} {phases} = {statistics.median(totals):.2f} s to the first token "
              f"(median of {runs}; {totals[0]:.2f}-{totals[-1]:.2f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, sys.argv[2] if len(sys.argv) > 2 else "mtp")
