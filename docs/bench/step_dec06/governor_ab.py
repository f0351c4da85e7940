"""The thread governor before and after its trials: one pipeline in a process of its own, in two source trees
alternating (``PYTHONPATH``), quiet or with ``while True: pass`` busy on one core from before the process starts.
Prints each process's tokens/s (the fastest of ``repeats`` requests after one warm-up) and what the governor did.

    python docs/bench/shared_cpu_dec06/governor_ab.py BEFORE_TREE AFTER_TREE [rounds] [repeats]

A tree is a checkout (``git worktree add /tmp/before 0d47d35``); both run with this interpreter, each process in
its tree's folder (``python -c`` puts the working folder first on the path).
"""
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import mtpflow
from mtpflow.backends.native.threads import GOVERNOR as G
overrides, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
pipe = mtpflow.pipeline("baseline", overrides=["max_new_tokens=64", "trace=off", *overrides])
prompt = "Explain how a bicycle works."
pipe(prompt)
best = 0.0
for _ in range(repeats):
    t0 = time.perf_counter()
    result = pipe(prompt)
    best = max(best, len(result.token_ids) / (time.perf_counter() - t0))
print(json.dumps({"tokens_per_s": round(best, 1), "switches": G.switches, "trials": getattr(G, "trials", None),
                  "one_thread": getattr(G, "one", None) if hasattr(G, "one") else bool(getattr(G, "left", 0))}))
"""


def one(tree: str, overrides: list[str], busy: bool, repeats: int) -> dict:
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(overrides), str(repeats)], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    if done.returncode != 0:
        sys.exit(done.stderr.strip().splitlines()[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(before: str, after: str, rounds: int, repeats: int) -> None:
    print("round  model  load  tree  tokens/s  switches  trials  on one thread at the end")
    for r in range(rounds):
        for model, overrides in (("float32", []), ("int8", ["model.quantize=int8"])):
            for busy in (False, True):
                trees = [("before", before), ("after", after)]
                for name, tree in trees if r % 2 == 0 else trees[::-1]:
                    row = one(tree, overrides, busy, repeats)
                    print(f"{r + 1}  {model}  {'one core busy' if busy else 'quiet'}  {name}  {row['tokens_per_s']}  "
                          f"{row['switches']}  {row['trials']}  {row['one_thread']}", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]) if len(a) > 2 else 2, int(a[3]) if len(a) > 3 else 3)
