"""How often lighter weights decode what float32 decodes: greedy outputs of HF ``generate`` on the float32
default model against mtpflow's greedy outputs with other weights, on the benchmark prompts.

    python scripts/weights_agreement.py                          # model.quantize=int8, all 32 prompts
    python scripts/weights_agreement.py model.dtype=bfloat16     # bf16
    python scripts/weights_agreement.py model.quantize=int8 --limit 2 --max-new-tokens 64

Prints, and writes to ``bench-results/weights_agreement.csv``: per prompt, whether the outputs are identical,
how many leading tokens they share, and the teacher-forced next-token agreement (along the float32 output,
the share of positions where both models' argmax is the same: how close the weights are, without one early
flip deciding everything after it); then the totals. The float32 reference is HF ``generate`` on the
float32 model (stock linears); the other side is the ``baseline`` strategy (K = 0) through the engine, which
with int8 weights is token-identical to HF ``generate`` on the same weights (tests/kernels/test_int8_linear.py;
in bf16 it is not always: docs/benchmarks.md). The teacher-forced column runs the lighter model's own forward
outside the engine (HF's, over the same weights), so it measures the weights, not mtpflow's kernels.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import mtpflow
from mtpflow.tools.bench import hf_generate, load_prompt_suite


@torch.inference_mode()
def next_token_agreement(reference_model, light_model, ids, output: list[int]) -> int:
    """Positions of ``output`` (after the prompt ``ids``) where both models' argmax agree, teacher-forced."""
    if not output:
        return 0
    x = torch.cat([ids, torch.tensor(output[:-1], dtype=torch.long)])[None]
    start = ids.numel() - 1
    a = reference_model(input_ids=x).logits[0, start:].argmax(-1)
    b = light_model(input_ids=x.to(light_model.device)).logits[0, start:].argmax(-1).cpu()
    return int((a == b).sum())


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", default=["model.quantize=int8"], help="model overrides for the lighter side")
    parser.add_argument("--limit", type=int, default=0, help="prompts per class (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="bench-results/weights_agreement.csv")
    args = parser.parse_args(argv)
    common = [f"max_new_tokens={args.max_new_tokens}", "trace=off"]
    reference = mtpflow.pipeline("baseline", overrides=common)  # float32: only its model is used
    light = mtpflow.pipeline("baseline", overrides=[*common, *args.overrides])
    suite = load_prompt_suite(limit=args.limit)
    ref_model = reference.loaded
    rows = []
    for item in tqdm(suite, desc="prompts", file=sys.stderr):
        ids = reference.encode(item["prompt"])
        ref, _ = hf_generate(ref_model.model, ids, args.max_new_tokens, ref_model.eos_token_ids)
        out = light(prompt_ids=ids).token_ids
        rows.append({"id": item["id"], "class": item["class"], "identical": out == ref,
                     "common_prefix": common_prefix(out, ref), "reference_tokens": len(ref), "tokens": len(out),
                     "next_token_agreement": next_token_agreement(ref_model.model, light.loaded.model, ids, ref)})
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    same = sum(r["identical"] for r in rows)
    prefix = sum(r["common_prefix"] for r in rows)
    total = sum(r["reference_tokens"] for r in rows)
    agree = sum(r["next_token_agreement"] for r in rows)
    print(f"{' '.join(args.overrides)} vs float32 HF greedy: {same}/{len(rows)} outputs identical; "
          f"first {prefix} of {total} reference tokens in common ({prefix / max(total, 1):.0%}); "
          f"teacher-forced next-token agreement {agree}/{total} ({agree / max(total, 1):.1%}); {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
