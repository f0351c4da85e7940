"""Engine throughput at batch 16 over the first 16 bench prompts (64 new tokens, first-time requests): best of 2."""
import json, sys, time
import torch
torch.set_num_threads(2)
from mtpflow.config import compose
from mtpflow.engine import Engine
from mtpflow.request import Request
extra = sys.argv[1:]
prompts = [json.loads(l)["prompt"] for l in open("mtpflow/data/bench_prompts.jsonl")][:16]
cfg = compose(["strategy=baseline", "max_new_tokens=64", "trace=off", "max_batch_size=16", "prefix_cache_mb=0", *extra])
engine = Engine(cfg)
engine.generate([Request(prompt=p, max_new_tokens=8) for p in prompts[:4]])
best = 0.0
for _ in range(2):
    engine.shared.clear()
    t0 = time.perf_counter()
    results = [h.result() for h in engine.submit_many([Request(prompt=p) for p in prompts])]
    tokens = sum(len(r.token_ids) for r in results)
    best = max(best, tokens / (time.perf_counter() - t0))
print(f"RESULT {' '.join(extra) or 'float32'} {best:.1f} tokens/s ({tokens} tokens)", flush=True)
engine.close() if hasattr(engine, "close") else None
