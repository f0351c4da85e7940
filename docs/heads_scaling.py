"""How the EAGLE drafter's accuracy and MAL grow with its training text (docs/heads_scaling.md).

The EAGLE layer is trained with the default settings (``mtpflow/conf/train_heads.yaml``) on nested subsets of the
default training text (the same held-out prompts for every subset), and each layer is measured twice:
held-out top-1 of the model's greedy choice at t+2, and the MAL of the ``eagle`` strategy on the benchmark
prompts (128 new tokens, greedy, the shipped PFS threshold with the cost budget off, so the MAL depends on
the heads alone and not on this host's timings). A straight line through MAL against log2(tokens) says how
much text a MAL would need, if the trend held.

    python -m mtpflow.train_heads "kinds=[]"       # write (or reuse) the default training text (~24 min)
    python docs/heads_scaling.py [limit] [fractions] [override ...]   # defaults: 2 0.125,0.25,0.5,1
    python docs/heads_scaling.py 2 1 eagle.intermediate_size=4096      # a wider layer on all the text
"""
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import make_pipeline  # noqa: E402

from mtpflow.tools.bench import load_prompt_suite  # noqa: E402
from mtpflow.tools.head_data import generated_tokens as tokens, load_shards  # noqa: E402
from mtpflow.model import load_model  # noqa: E402
from mtpflow.strategies.head_modules import draft_index, save_heads  # noqa: E402
from mtpflow.tools.train_heads import compose, data_folder, pick_draft_vocab, split_by_prompt, train_eagle  # noqa: E402

limit = int(sys.argv[1]) if len(sys.argv) > 1 else 2
fractions = [float(f) for f in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0.125, 0.25, 0.5, 1.0]
cfg = compose(sys.argv[3:])  # train_heads overrides, e.g. eagle.steps=4000
torch.set_num_threads(2)
L = load_model("smollm2")
folder, _ = data_folder(cfg, L.model_id)
shards = sorted(folder.glob("shard_*.pt"))
expected = -(-int(cfg.data.samples) // int(cfg.data.batch_size))
if len(shards) < expected:
    sys.exit(f"{folder} has {len(shards)} of {expected} shards: run `python -m mtpflow.train_heads \"kinds=[]\"` first")
records = load_shards(shards)
held_out, train = split_by_prompt(records, 0.1, int(cfg.seed))  # as train_heads does: one split for all subsets
lm_weight = L.model.get_output_embeddings().weight.detach().float()
embed_weight = L.model.get_input_embeddings().weight.detach().float()
vocab, hidden = lm_weight.shape[0], L.model.config.hidden_size
suite = load_prompt_suite(limit=limit)


rows = []
for frac in fractions:
    subset = train[: max(1, round(len(train) * frac))]  # train is shuffled, so a prefix is a random subset
    draft_ids = pick_draft_vocab(subset, int(cfg.draft_vocab), vocab)
    index, draft_weight = draft_index(draft_ids, vocab), lm_weight[draft_ids]
    t0 = time.perf_counter()
    drafter, metrics, layer_cfg = train_eagle(cfg.eagle, subset, held_out, lambda f: f @ draft_weight.T, index,
                                              lambda ids: embed_weight[ids], hidden, int(cfg.seed))
    train_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as out:
        save_heads(Path(out) / "eagle", drafter, draft_ids,
                   {"model_id": L.model_id, "model_name": "smollm2", "hidden_size": hidden, "vocab_size": vocab,
                    "kind": "eagle", "num_heads": 1, **layer_cfg})
        pipe = make_pipeline(L, "eagle", f"model.heads={out}", "max_new_tokens=128", "strategy.prune.0.costs=null",
                             "trace=off")
        stats = [pipe(r["prompt"]).stats for r in suite]
    steps_run = sum(s["verify_forwards"] for s in stats)
    per_class = {}
    for r, s in zip(suite, stats):
        per_class.setdefault(r["class"], []).append(s)
    row = {"fraction": frac, "sequences": len(subset), "train_tokens": tokens(subset),
           "held_out_top1": metrics["held_out_top1"][0], "best_step": metrics["best_step"],
           "mal": round(sum(s["new_tokens"] - 1 for s in stats) / steps_run, 3),
           "per_class_mal": {c: round(sum(s["new_tokens"] - 1 for s in v) / sum(s["verify_forwards"] for s in v), 3)
                             for c, v in per_class.items()},
           "train_seconds": round(train_s, 1)}
    rows.append(row)
    print(json.dumps(row), flush=True)

# least squares of MAL on log2(train tokens), and the text MAL 3.0 (#3's target) would need if the line held
if len(rows) > 1:
    xs, ys = [math.log2(r["train_tokens"]) for r in rows], [r["mal"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    need = 2 ** (mx + (3.0 - my) / slope) if slope > 0 else float("inf")
    print(json.dumps({"mal_per_doubling": round(slope, 4), "tokens_for_mal_3": need,
                      "times_the_default": need / tokens(train)}))
