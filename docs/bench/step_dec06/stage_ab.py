"""What the loop spends around the verify forward, per step, in two source trees alternating: one process per tree
and round decodes ``prompts`` first-time prompts (every 97th of mtpflow/data/domain_prompts.jsonl, none of them
the bench's) with ``strategy`` over the int8 model, 128 new tokens, and prints tokens/s, ms per step, MAL, the
step's time outside its verify forward and the propose and prune stages' (the loop's own stage timer,
``StepRecord.stage_seconds``).

    python docs/bench/step_dec06/stage_ab.py BEFORE_TREE AFTER_TREE [strategy] [prompts] [rounds]
"""
import json
import os
import subprocess
import sys

CHILD = r"""
import collections, json, sys, time
import mtpflow
strategy, n = sys.argv[1], int(sys.argv[2])
pipe = mtpflow.pipeline(strategy, overrides=["model.quantize=int8", "max_new_tokens=128", "trace=off"])
lines = open("mtpflow/data/domain_prompts.jsonl").read().splitlines()
prompts = [json.loads(line)["text"] for line in lines][::97][:n]
pipe(prompts[0])
ms, steps, tokens = collections.Counter(), 0, 0
t0 = time.perf_counter()
for prompt in prompts:
    result = pipe(prompt)
    tokens += len(result.token_ids)
    steps += len(result.steps)
    for s in result.steps:
        ms["step"] += 1000 * s.step_seconds
        for name, seconds in s.stage_seconds.items():
            ms[name] += 1000 * seconds
seconds = time.perf_counter() - t0
print(json.dumps({"tokens_per_s": tokens / seconds, "ms_per_step": 1000 * seconds / steps, "mal": tokens / steps,
                  "outside_verify": (ms["step"] - ms["verify"]) / steps, "propose": ms["propose"] / steps,
                  "prune": ms["prune"] / steps}))
"""


def main(before: str, after: str, strategy: str, prompts: int, rounds: int) -> None:
    print(f"{strategy} over int8, {prompts} prompts; ms per step")
    print("round  tree  tokens/s  ms/step  MAL  outside verify  propose  prune")
    for r in range(rounds):
        trees = [("before", before), ("after", after)]
        for name, tree in trees if r % 2 == 0 else trees[::-1]:
            done = subprocess.run([sys.executable, "-c", CHILD, strategy, str(prompts)], capture_output=True, text=True,
                                  timeout=900, env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
            if done.returncode != 0:
                sys.exit(done.stderr.strip().splitlines()[-1])
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{r + 1}  {name}  {row['tokens_per_s']:.1f}  {row['ms_per_step']:.2f}  {row['mal']:.2f}  "
                  f"{row['outside_verify']:.3f}  {row['propose']:.3f}  {row['prune']:.3f}", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2] if len(a) > 2 else "mtp_heads", int(a[3]) if len(a) > 3 else 8,
         int(a[4]) if len(a) > 4 else 2)
