"""`mtp_heads` over the int8 model with and without its grafted drafters, and with smaller trees, in one process.

Each variant is a pipeline with config overrides; the bench's prompts ``lo``..``hi`` run as first-time requests
(the shared caches cleared but for the trained heads), 128 new tokens, greedy, the variants alternating per prompt
(the order reversed every other prompt: ``alternating.py``). Prints tokens/s, the ratio to `baseline` and the
tokens per step.

    python docs/bench/attention_dec06/heads_variants.py [lo] [hi]
"""
import sys

from alternating import alternate, pipelines

NO_GRAFTS = ["strategy.propose.recycling=null", "strategy.propose.suffix=null"]
VARIANTS = {
    "baseline": ("baseline", []),
    "mtp_heads": ("mtp_heads", []),
    "no recycling/suffix, 12 nodes": ("mtp_heads", NO_GRAFTS),
    "no recycling/suffix, 8 nodes": ("mtp_heads", [*NO_GRAFTS, "strategy.prune.0.max_nodes=8"]),
    "no recycling/suffix, 6 nodes": ("mtp_heads", [*NO_GRAFTS, "strategy.prune.0.max_nodes=6"]),
    "heads alone, 6 nodes": ("mtp_heads", [*NO_GRAFTS, "strategy.prune.0.max_nodes=6", "strategy.propose.lookup=null"]),
    "pld": ("pld", []),
}


def main(lo: int, hi: int) -> None:
    acc = alternate(pipelines(VARIANTS), lo, hi)
    base = acc["baseline"][1] / acc["baseline"][0]
    print(f"prompts {lo}..{hi - 1}, int8 target")
    for label, (seconds, tokens, steps) in acc.items():
        print(f"{label:>32}  {tokens / seconds:6.1f} tokens/s  {tokens / seconds / base:5.2f}x  MAL {tokens / steps:.2f}",
              flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, int(sys.argv[2]) if len(sys.argv) > 2 else 32)
