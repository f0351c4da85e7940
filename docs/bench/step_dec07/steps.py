"""Where one strategy's decode steps go: the bench's first N prompts (128 new tokens, greedy, trace off) through one
pipeline after a warm-up request; tokens/s (wall, prefills included), steps, MAL, the mean verify forward and step,
the draft sizes verified, the tokens emitted per step, each stage's mean ms per step and the median verify forward by
draft size. Extra arguments are config overrides.

    python docs/bench/step_dec07/steps.py STRATEGY N [override ...]
"""
import collections
import json
import sys
import time

import mtpflow

pipe = mtpflow.pipeline(sys.argv[1], overrides=["max_new_tokens=128", "trace=off"] + sys.argv[3:])
prompts = [json.loads(line)["prompt"] for line in open("mtpflow/data/bench_prompts.jsonl")]
pipe(prompts[-1])  # warm-up: kernels built, the int8 draft model made
sizes, emitted, stage, by_nodes = collections.Counter(), collections.Counter(), collections.Counter(), {}
forward = step = 0.0
steps = tokens = 0
t0 = time.perf_counter()
for p in prompts[:int(sys.argv[2])]:
    r = pipe(p)
    tokens += len(r.token_ids)
    for s in r.steps:
        steps += 1
        sizes[s.draft.num_nodes] += 1
        emitted[len(s.emitted)] += 1
        by_nodes.setdefault(s.draft.num_nodes, []).append(s.forward_seconds)
        forward, step = forward + s.forward_seconds, step + s.step_seconds
        for k, v in s.stage_seconds.items():
            stage[k] += v
wall = time.perf_counter() - t0
print(f"{sys.argv[1]}: {tokens / wall:.1f} tokens/s, {steps} steps, MAL {tokens / steps:.2f}, verify forward "
      f"{1000 * forward / steps:.2f} ms, step {1000 * step / steps:.2f} ms")
print("  draft sizes:", sorted(sizes.items()), " emitted per step:", sorted(emitted.items()))
print("  stages (ms per step):", {k: round(1000 * v / steps, 3) for k, v in stage.items()})
print("  median verify forward (ms) by draft size:",
      {k: round(1000 * sorted(v)[len(v) // 2], 2) for k, v in sorted(by_nodes.items())})
