"""The engine's prefix KV cache on vs off, same process (docs/benchmarks.md, "Batches").

    python scripts/prefix_cache_ab.py [ROUNDS]     # default 4

1. First-time requests: the 16 held-in prompts (4 per class) x 128 new tokens at batch 16, the cache cleared
   before each run, on and off interleaved; tokens/s (medians) and whether the outputs are identical.
2. Repeated requests: the same 16 once after a clear and again with the cache kept; summed prefill seconds.
3. One request alone: a prompt's prefill the first time and repeated (medians over the first 8 prompts).
"""
from __future__ import annotations

import statistics
import sys
import time

from mtpflow.config import compose
from mtpflow.engine import Engine
from mtpflow.request import Request
from mtpflow.tools.bench import load_prompt_suite

ON_BYTES = 256 * 2**20


def run(engine, prompts, **kw):
    t0 = time.perf_counter()
    results = engine.generate([Request(prompt_ids=p, **kw) for p in prompts])
    return results, time.perf_counter() - t0


def main(rounds: int) -> None:
    suite = load_prompt_suite(None, None, 4)
    engine = Engine(compose(["strategy=baseline", "max_new_tokens=128", "trace=off", "max_batch_size=16",
                             "batch_k=off"]))
    prompts = [engine.prepare(Request(prompt=item["prompt"]))[0].prompt_ids for item in suite]
    run(engine, prompts[:4], max_new_tokens=8)  # warm-up
    rates, outputs = {"on": [], "off": []}, {}
    for rnd in range(rounds):
        for name in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            engine.prefix_cache_bytes = ON_BYTES if name == "on" else 0
            engine.shared.clear()
            results, seconds = run(engine, prompts)
            tokens = sum(len(r.token_ids) for r in results)
            rates[name].append(tokens / seconds)
            outputs.setdefault(name, [r.token_ids for r in results])
            reused = sum(r.stats.get("prefix_cached_tokens", 0) for r in results)
            print(f"round {rnd} {name}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tokens/s, "
                  f"{reused} prompt tokens reused", flush=True)
    print(f"first-time, batch 16: on {statistics.median(rates['on']):.1f} vs off "
          f"{statistics.median(rates['off']):.1f} tokens/s (medians); outputs identical: {outputs['on'] == outputs['off']}")

    engine.prefix_cache_bytes = ON_BYTES
    engine.shared.clear()
    for label in ("first", "repeated"):
        results, seconds = run(engine, prompts)
        print(f"{label}: prefill seconds summed {sum(r.stats['prefill_seconds'] for r in results):.2f}, "
              f"{sum(r.stats.get('prefix_cached_tokens', 0) for r in results)} prompt tokens reused")
    engine.shared.clear()
    pairs = [tuple(run(engine, [p], max_new_tokens=2)[0][0].stats["prefill_seconds"] for _ in range(2))
             for p in prompts[:8]]
    print(f"one request alone, prefill ms first vs repeated (medians): "
          f"{1000 * statistics.median(a for a, _ in pairs):.1f} vs {1000 * statistics.median(b for _, b in pairs):.1f}")
    engine.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
