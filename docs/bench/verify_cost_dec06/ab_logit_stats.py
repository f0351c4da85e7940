"""In-process A/B of the native logit statistics (mtpflow/backends/native/logit_stats.c): every strategy decodes each
of the bench's prompts twice, with the native pass and with it switched off (torch's argmax, logsumexp and topk, as
before), the order alternating per prompt, so both sides see the same machine state. First-time requests (the
shared caches cleared before each), 128 new tokens, greedy, trace off.

    python docs/bench/verify_cost_dec06/ab_logit_stats.py baseline,pld,suffix_cache,mtp_heads,recycling \
        [int8|float32] [every]

``every``: every n-th prompt of the 32 (default 1: all). Prints tokens/s and ms a step of each side.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mtpflow
from mtpflow.backends.native import rows as native_rows

PROMPTS = Path(mtpflow.__file__).parent / "data" / "bench_prompts.jsonl"


def main(strategies: list[str], precision: str, every: int) -> None:
    items = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][::every]
    overrides = ["max_new_tokens=128", "trace=off"] + (["model.quantize=int8"] if precision == "int8" else [])
    pipes = {s: mtpflow.pipeline(s, overrides=overrides) for s in strategies}
    for pipe in pipes.values():
        pipe("Hello there, how are you?")  # warm: the kernel built, the tuning profile read
    native = native_rows.kernel.logit_stats
    totals = {(s, on): [0.0, 0, 0] for s in strategies for on in (False, True)}
    for i, item in enumerate(items):
        for s, pipe in pipes.items():
            ids = pipe.encode(item["prompt"])
            for on in ((False, True) if i % 2 else (True, False)):
                native_rows.kernel.logit_stats = native if on else (lambda *args, **kwargs: None)
                pipe.shared.clear()
                t0 = time.perf_counter()
                result = pipe(prompt_ids=ids)
                total = totals[(s, on)]
                total[0] += time.perf_counter() - t0
                total[1] += len(result.token_ids)
                total[2] += len(result.steps)
    native_rows.kernel.logit_stats = native
    print(f"{precision}, {len(items)} prompts")
    print("| strategy | torch: tokens/s | ms a step | native: tokens/s | ms a step | native / torch | MAL |")
    print("|---|---|---|---|---|---|---|")
    for s in strategies:
        (a, na, sa), (b, nb, sb) = totals[(s, False)], totals[(s, True)]
        print(f"| `{s}` | {na / a:.1f} | {a / sa * 1000:.2f} | {nb / b:.1f} | {b / sb * 1000:.2f} | "
              f"{(nb / b) / (na / a):.3f}x | {nb / sb:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2] if len(sys.argv) > 2 else "int8",
         int(sys.argv[3]) if len(sys.argv) > 3 else 1)
