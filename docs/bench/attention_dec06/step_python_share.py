"""How much of a decode step runs in the native kernel and how much in Python, per strategy, over the int8 model.

One process builds a pipeline per strategy and decodes the bench's prompts ``lo``..``hi`` (first-time requests:
the shared caches cleared but for the trained heads), 128 new tokens, greedy, the strategies alternating per
prompt (the order reversed every other prompt). It times every ``Engine._step`` and, inside the steps, every call
into the native library (``kernel.call``: the decoder stack, the logit statistics, the heads' products). The rest
of a step is Python: planning, the stages, the bookkeeping, the ctypes calls' arguments.

    python docs/bench/attention_dec06/step_python_share.py [lo] [hi] [strategy,...]
"""
import json
import sys
import time
from pathlib import Path

import mtpflow
from mtpflow import engine as engine_module
from mtpflow.backends.native import kernel

PROMPTS = Path(mtpflow.__file__).parent / "data" / "bench_prompts.jsonl"


def main(lo: int, hi: int, strategies: list[str]) -> None:
    items = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][lo:hi]
    acc = {name: {"step": 0.0, "c": 0.0, "steps": 0, "tokens": 0, "wall": 0.0} for name in strategies}
    now = {"in_step": False, "name": None}

    step, call = engine_module.Engine._step, kernel.call

    def timed_step(self, *a, **k):
        t0, now["in_step"] = time.perf_counter(), True
        try:
            return step(self, *a, **k)
        finally:
            now["in_step"] = False
            acc[now["name"]]["step"] += time.perf_counter() - t0
            acc[now["name"]]["steps"] += 1

    def timed_call(*a, **k):
        if not now["in_step"]:
            return call(*a, **k)
        t0 = time.perf_counter()
        try:
            return call(*a, **k)
        finally:
            acc[now["name"]]["c"] += time.perf_counter() - t0

    engine_module.Engine._step, kernel.call = timed_step, timed_call
    pipes = {name: mtpflow.pipeline(name, overrides=["max_new_tokens=128", "model.quantize=int8", "trace=off"])
             for name in strategies}
    for name, pipe in pipes.items():
        now["name"] = name
        pipe(prompt_ids=pipe.encode("Hello there, how are you?"))  # warm-up
    for a in acc.values():
        a.update(step=0.0, c=0.0, steps=0)
    for i, item in enumerate(items):
        for name in strategies if i % 2 == 0 else strategies[::-1]:
            pipe, now["name"] = pipes[name], name
            ids = pipe.encode(item["prompt"])
            pipe.shared.clear(keep=lambda key: key.startswith("heads:"))
            t0 = time.perf_counter()
            result = pipe(prompt_ids=ids)
            acc[name]["wall"] += time.perf_counter() - t0
            acc[name]["tokens"] += len(result.token_ids)
    print(f"prompts {lo}..{hi - 1}: per decode step, ms")
    for name, a in acc.items():
        step_ms, c_ms = 1000 * a["step"] / a["steps"], 1000 * a["c"] / a["steps"]
        print(f"{name:>14}  {a['tokens'] / a['wall']:6.1f} tokens/s  {a['steps']:5d} steps  step {step_ms:6.2f}  "
              f"native {c_ms:6.2f}  Python {step_ms - c_ms:5.2f} ({(step_ms - c_ms) / step_ms:5.1%})", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, int(sys.argv[2]) if len(sys.argv) > 2 else 12,
         sys.argv[3].split(",") if len(sys.argv) > 3 else ["baseline", "pld", "mtp_heads"])
