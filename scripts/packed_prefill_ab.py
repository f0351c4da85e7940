"""Packed prefill against one prompt at a time, in one process: the engine decodes the same requests
(default: the 16 held-in prompts of the batch benchmark, 128 new tokens, ``baseline``, batch 16) in interleaved
rounds, once with ``mtpflow.target.PACKED_PREFILL_ROWS`` as shipped and once with it at 0 (every prompt
prefilled alone), and prints the summed prefill seconds, the total tokens/s per round and their medians, and
whether the outputs are identical.

    python scripts/packed_prefill_ab.py [ROUNDS] [STRATEGY] [BATCH]
"""
from __future__ import annotations

import statistics
import sys
import time

from mtpflow import engine as engine_module
from mtpflow import target
from mtpflow.config import compose
from mtpflow.engine import Engine
from mtpflow.request import Request
from mtpflow.tools.bench import load_prompt_suite


def main(rounds: int = 4, strategy: str = "baseline", batch: int = 16) -> None:
    prefill = {"seconds": 0.0}
    real = target.prefill_many

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            prefill["seconds"] += time.perf_counter() - t0

    engine_module.prefill_many = timed
    engine = Engine(compose([f"strategy={strategy}", "max_new_tokens=128", "trace=off", f"max_batch_size={batch}",
                             "prefix_cache_mb=0"]))
    prompts = [engine.prepare(Request(prompt=item["prompt"]))[0].prompt_ids
               for item in load_prompt_suite(None, None, 4)]
    print(f"{len(prompts)} prompts, {sum(int(p.numel()) for p in prompts)} prompt tokens", flush=True)
    engine.generate([Request(prompt_ids=p, max_new_tokens=4) for p in prompts[:2]])  # warm-up
    shipped = target.PACKED_PREFILL_ROWS
    results: dict[str, list[tuple[float, float]]] = {"packed": [], "alone": []}
    outputs: dict[str, list] = {}
    for r in range(rounds):
        for name, rows in (("packed", shipped), ("alone", 0)) if r % 2 == 0 else (("alone", 0), ("packed", shipped)):
            target.PACKED_PREFILL_ROWS = rows
            engine.shared.clear()
            prefill["seconds"] = 0.0
            t0 = time.perf_counter()
            done = engine.generate([Request(prompt_ids=p) for p in prompts])
            seconds = time.perf_counter() - t0
            tokens = sum(len(d.token_ids) for d in done)
            results[name].append((prefill["seconds"], tokens / seconds))
            outputs.setdefault(name, [d.token_ids for d in done])
            print(f"round {r} {name:6s} prefill {prefill['seconds']:.2f} s, {tokens} tokens, "
                  f"{tokens / seconds:.1f} tokens/s", flush=True)
    target.PACKED_PREFILL_ROWS = shipped
    engine.close()
    for name, rows in results.items():
        print(f"{name:6s} median prefill {statistics.median(p for p, _ in rows):.2f} s, "
              f"median {statistics.median(t for _, t in rows):.1f} tokens/s")
    print("outputs identical:", outputs["packed"] == outputs["alone"])


if __name__ == "__main__":
    main(*(int(a) if i != 1 else a for i, a in enumerate(sys.argv[1:])))
