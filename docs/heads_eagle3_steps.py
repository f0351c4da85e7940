"""Per-step top-1 accuracy of the shipped EAGLE and EAGLE-3 drafters on the benchmark prompts (which neither saw in
training): the default model writes its greedy answers (128 new tokens) with its hidden states and EAGLE-3's tapped
layers, then each drafter drafts 1, 2, 3 steps ahead from every generated position, from its own earlier outputs
(as tree drafting does; the earlier tokens are the model's own, so step s is the accuracy given an accepted prefix).
Tokens outside a drafter's draft vocabulary are not counted.

    python docs/heads_eagle3_steps.py [limit_per_class=8] [threads=1]
"""
from __future__ import annotations

import json
import sys
from importlib import resources

import torch


def main(limit: int = 8, threads: int = 1) -> None:
    from mtpflow.types import hidden_taps
    from mtpflow.model import load_configured
    from mtpflow.request import encode_prompt
    from mtpflow.strategies.head_modules import draft_index, load_heads
    from mtpflow.strategies.mtp_heads import shipped_heads
    from mtpflow.tools.head_data import sample_batch
    from mtpflow.tools.train_heads import compose, drafter_crops, unrolled_accuracy

    torch.set_num_threads(threads)
    loaded = load_configured(compose([]).model)
    model = loaded.model
    rows = [json.loads(line) for line in resources.files("mtpflow.data").joinpath("bench_prompts.jsonl")
            .read_text(encoding="utf-8").splitlines() if line.strip()]
    per_class: dict[str, list] = {}
    for r in rows:
        per_class.setdefault(r.get("class", "all"), []).append(r["prompt"])
    prompts = [p for ps in per_class.values() for p in ps[:limit]]
    encoded = sorted((encode_prompt(loaded.tokenizer, p) for p in prompts), key=len)
    records = []
    for lo in range(0, len(encoded), 8):
        records += sample_batch(model, encoded[lo:lo + 8], 128, 0.0, set(loaded.eos_token_ids), torch.Generator(),
                                hidden_taps(model, "eagle3"))
    longest = max(r["hidden"].shape[0] for r in records)
    lm_weight = model.get_output_embeddings().weight.detach().float()
    embed_weight = model.get_input_embeddings().weight.detach().float()
    result = {"prompts": len(records), "generated_tokens": sum(int(r["tokens"].numel()) - r["prompt_len"] for r in records)}
    for kind, key in (("eagle", "hidden"), ("eagle3", "taps")):
        drafter, ids, _ = load_heads(shipped_heads("smollm2", kind))
        index = draft_index(ids, lm_weight.shape[0])
        weight = lm_weight[ids]
        crops = drafter_crops(records, longest, torch.Generator().manual_seed(0), lambda t: embed_weight[t], index, key)
        result[kind] = unrolled_accuracy(drafter, crops, lambda f: f @ weight.T, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    main(int(args.get("limit_per_class", 8)), int(args.get("threads", 1)))
