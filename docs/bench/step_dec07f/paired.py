"""Strategies compared question by question over the int8 model: every variant decodes each question in turn (the
order rotating), so the host's drift between minutes falls on all of them alike. Spec-Bench questions under 1500
characters (first turn), 128 new tokens, greedy (FLOAT32=1: the float32 model), after one warm-up request each; prints tokens/s, MAL and the ratio
to the first variant. Strategy arguments take ``|``-separated overrides.

    [SKIP=30] [FLOAT32=1] python docs/bench/step_dec07f/paired.py PATH/question.jsonl N baseline mtp_heads "mtp_heads|strategy.propose.graft_costs=false"
"""
import json
import os
import sys
import time

from mtpflow.api import pipeline

path, count, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
skip = int(os.environ.get("SKIP", "0"))  # questions passed over first (another slice of the file)
prompts = [q for q in (json.loads(line)["turns"][0] for line in open(path)) if len(q) < 1500]
pipes = []
for variant in variants:
    name, *overrides = variant.split("|")
    target = [] if os.environ.get("FLOAT32") == "1" else ["model.quantize=int8"]
    pipes.append(pipeline(name, target + ["trace=off", "max_new_tokens=128"] + overrides))
    pipes[-1](prompts[0])
seconds, tokens, steps = [0.0] * len(pipes), [0] * len(pipes), [0] * len(pipes)
outputs = {}
for n, q in enumerate(prompts[1 + skip:1 + skip + count]):
    order = list(range(len(pipes)))
    order = order[n % len(order):] + order[:n % len(order)]
    for i in order:
        t = time.perf_counter()
        r = pipes[i](q)
        seconds[i] += time.perf_counter() - t
        tokens[i] += len(r.token_ids)
        steps[i] += r.stats["verify_forwards"]
        outputs.setdefault(n, r.token_ids)
        assert r.token_ids == outputs[n], f"{variants[i]} differs on question {n}"  # every variant is lossless
for i, variant in enumerate(variants):
    rate = tokens[i] / seconds[i]
    print(f"{variant:60s} tok/s {rate:7.2f}  MAL {tokens[i] / steps[i]:.2f}  x first {rate / (tokens[0] / seconds[0]):.3f}")
