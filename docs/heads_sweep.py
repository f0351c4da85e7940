"""MAL and compression vs the PFS threshold for the medusa and eagle strategies (and mtp) on the default model (docs/heads_sweep.md)."""
import sys, time, json, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent.parent / 'tests'))
from helpers import make_pipeline
from mtpflow.model import load_model
from mtpflow.tools.bench import load_prompt_suite
L = load_model('smollm2')
rows = load_prompt_suite(limit=1)
n = int(sys.argv[1])
# threshold alone (cost budget off), then the shipped setting: threshold 0.35 plus the cost-aware budget
configs = [(k, t, "null") for k in ("medusa", "eagle") for t in (0.0, 0.1, 0.2, 0.35, 0.5)]
configs += [(k, 0.35, "auto") for k in ("medusa", "eagle")]
configs += [("mtp", 0.35, c) for c in ("null", "auto")]  # Medusa tree + grafted prompt-lookup chain
if len(sys.argv) > 2:  # only these strategies, e.g. `python docs/heads_sweep.py 48 mtp`
    configs = [c for c in configs if c[0] in sys.argv[2].split(",")]
out = []
for kind, t, costs in configs:
    pipe = make_pipeline(L, kind, f"max_new_tokens={n}", f"strategy.prune.0.threshold={t}",
                         f"strategy.prune.0.costs={costs}", "trace=off")
    t0 = time.perf_counter()
    stats = [pipe(r["prompt"]).stats for r in rows]
    seconds = time.perf_counter() - t0
    steps = sum(s["verify_forwards"] for s in stats); toks = sum(s["new_tokens"] - 1 for s in stats)
    rec = {"strategy": kind, "threshold": t, "cost_budget": costs, "mal": round(toks / steps, 3),
           "tokens_per_s": round(sum(s["new_tokens"] for s in stats) / seconds, 2),
           "compression_rate": round(sum(s["draft_tokens"] for s in stats) / max(1, sum(s["proposed_tokens"] for s in stats)), 3),
           "per_class_mal": {r["class"]: s["mal"] for r, s in zip(rows, stats)}}
    out.append(rec); print(json.dumps(rec), flush=True)

