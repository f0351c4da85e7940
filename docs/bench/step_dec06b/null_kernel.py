"""The Python a decode step costs around the int8 model's decoder stack: two source trees alternating, one process per
tree, strategy and round; in each, ``mtpflow_w8a8_rows`` is replaced by a copy of fixed random logits (no
compute; the token ids < 8, where SmolLM2's special tokens lie, never win), so what a step takes is everything else:
the loop, the stages, the rows and struct of the call, the logits' statistics, the engine. 11 requests of 128 new
tokens over the int8 model after one warm-up; prints ms per step (wall). The drafters' own native products (the
heads') still run. With random logits the drafts differ from a real run's, and so do MAL and the steps' count:
compare trees per strategy, not strategies with each other.

    python docs/bench/step_dec06b/null_kernel.py BEFORE_TREE AFTER_TREE [strategy,...] [rounds]
"""
import json
import os
import subprocess
import sys

CHILD = r"""
import ctypes, sys, time
import numpy as np
import mtpflow
from mtpflow.backends.native import kernel
table = np.random.default_rng(0).standard_normal((64, 49152)).astype(np.float32) * 3
table[:, :8] = -30
served = [0]
def fake(lib, **m):
    if m.get("logits"):
        rows = m["M"] - m["head_from"]
        out = np.ctypeslib.as_array(ctypes.cast(m["logits"], ctypes.POINTER(ctypes.c_float)), shape=(rows, m["vocab"]))
        for r in range(rows):
            served[0] += 1
            out[r] = table[served[0] % 64][:m["vocab"]]
    return 0
kernel.w8a8_rows = fake
pipe = mtpflow.pipeline(sys.argv[1], overrides=["model.quantize=int8", "max_new_tokens=128", "trace=off"])
prompts = [f"Write about topic number {i} in detail." for i in range(12)]
pipe(prompts[0])
t0, steps = time.perf_counter(), 0
for p in prompts[1:]:
    steps += len(pipe(p).steps)
print(1000 * (time.perf_counter() - t0) / steps, steps)
"""


def main(before: str, after: str, strategies: list[str], rounds: int) -> None:
    print("ms per step (wall) with the decoder stack's call replaced; steps in brackets")
    for r in range(rounds):
        trees = [("before", before), ("after", after)]
        for strategy in strategies:
            cells = []
            for name, tree in trees if r % 2 == 0 else trees[::-1]:
                done = subprocess.run([sys.executable, "-c", CHILD, strategy], capture_output=True, text=True,
                                      timeout=900, env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
                if done.returncode != 0:
                    sys.exit(done.stderr.strip().splitlines()[-1])
                ms, steps = done.stdout.strip().splitlines()[-1].split()
                cells.append(f"{name} {float(ms):.3f} ({steps})")
            print(f"round {r + 1}  {strategy:10s}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], (a[2] if len(a) > 2 else "baseline,pld,mtp_heads").split(","), int(a[3]) if len(a) > 3 else 3)
