"""How much of a decode step runs in the native kernel and how much in Python, per strategy, over the int8 model.

One process builds a pipeline per strategy and decodes the bench's prompts ``lo``..``hi`` (first-time requests:
the shared caches cleared but for the trained heads), 128 new tokens, greedy, the strategies alternating per
prompt (the order reversed every other prompt: ``alternating.py``). It times every ``Engine._step`` and, inside
the steps, every call into the native library (``kernel.call``: the decoder stack, the logit statistics, the
heads' products). The rest of a step is Python: planning, the stages, the bookkeeping, the ctypes calls'
arguments.

    python docs/bench/attention_dec06/step_python_share.py [lo] [hi] [strategy,...]
"""
import sys
import time

from alternating import alternate, pipelines
from mtpflow import engine as engine_module
from mtpflow.backends.native import kernel


def main(lo: int, hi: int, strategies: list[str]) -> None:
    timed = {name: {"step": 0.0, "native": 0.0, "steps": 0} for name in strategies}
    now = {"in_step": False, "name": strategies[0]}
    step, call = engine_module.Engine._step, kernel.call

    def timed_step(self, *a, **k):
        t0, now["in_step"] = time.perf_counter(), True
        try:
            return step(self, *a, **k)
        finally:
            now["in_step"] = False
            timed[now["name"]]["step"] += time.perf_counter() - t0
            timed[now["name"]]["steps"] += 1

    def timed_call(*a, **k):
        if not now["in_step"]:
            return call(*a, **k)
        t0 = time.perf_counter()
        try:
            return call(*a, **k)
        finally:
            timed[now["name"]]["native"] += time.perf_counter() - t0

    pipes = pipelines({name: (name, []) for name in strategies})  # warm-ups: before the hooks, not counted
    engine_module.Engine._step, kernel.call = timed_step, timed_call
    acc = alternate(pipes, lo, hi, before=lambda name: now.update(name=name))
    print(f"prompts {lo}..{hi - 1}: per decode step, ms")
    for name, t in timed.items():
        step_ms, c_ms = 1000 * t["step"] / t["steps"], 1000 * t["native"] / t["steps"]
        seconds, tokens, _ = acc[name]
        print(f"{name:>14}  {tokens / seconds:6.1f} tokens/s  {t['steps']:5d} steps  step {step_ms:6.2f}  "
              f"native {c_ms:6.2f}  Python {step_ms - c_ms:5.2f} ({(step_ms - c_ms) / step_ms:5.1%})", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, int(sys.argv[2]) if len(sys.argv) > 2 else 12,
         sys.argv[3].split(",") if len(sys.argv) > 3 else ["baseline", "pld", "mtp_heads"])
