"""Where a step of the int8 model goes, per strategy: 12 Spec-Bench questions under 1500 characters (first turn),
128 new tokens, after one warm-up request; the C forward (``kernel.w8a8_rows``: verify forwards and the prompts'
prefill), the heads' products, logit_stats, and the loop's plan and finish, each summed over the run and divided by
its verify forwards. Strategy arguments take ``|``-separated overrides.

    python docs/bench/step_dec07d/step_split.py PATH/question.jsonl baseline pld mtp_heads "mtp_heads|strategy.propose.recycling=null"
"""
import json
import sys
import time

import mtpflow.loop as L
from mtpflow.backends.native import kernel, products

acc = {}


def wrap(obj, name, key):
    orig = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        r = orig(*a, **k)
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
        return r
    setattr(obj, name, timed)


wrap(kernel, "w8a8_rows", "forward_kernel")
wrap(products, "gemm_w8a8", "head_products")
wrap(kernel, "logit_stats", "logit_stats")
wrap(L.Sequence, "plan", "plan")
wrap(L.Sequence, "finish", "finish")
from mtpflow.api import pipeline  # noqa: E402 - after the wrappers: the loop imports kernel's names at call time

prompts = [q for q in (json.loads(line)["turns"][0] for line in open(sys.argv[1])) if len(q) < 1500]
for strategy in sys.argv[2:]:
    name, *overrides = strategy.split("|")
    p = pipeline(name, ["model.quantize=int8", "trace=off", "max_new_tokens=128"] + overrides)
    p(prompts[0])
    acc.clear()
    t = time.perf_counter()
    n = steps = nodes = 0
    for q in prompts[1:13]:
        r = p(q)
        n, steps, nodes = n + len(r.token_ids), steps + r.stats["verify_forwards"], nodes + r.stats["draft_tokens"]
    wall = time.perf_counter() - t
    print(f"{strategy:40s} tok/s {n / wall:6.1f} MAL {n / steps:.2f} nodes/step {nodes / steps:.1f} | ms/step: "
          f"wall {wall / steps * 1e3:.2f}", " ".join(f"{k} {v / steps * 1e3:.3f}" for k, v in acc.items()), flush=True)
