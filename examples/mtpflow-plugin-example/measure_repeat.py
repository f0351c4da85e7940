"""Measure what the output history buys: MAL and tokens/s of the ``suffix`` strategy on a request seen for the
first time, the same request again, and a similar request, next to ``pld`` and ``baseline``, all in one process
on the same model (so timing ratios are comparable even on a busy machine; absolute numbers are not).

    python examples/mtpflow-plugin-example/measure_repeat.py [max_new_tokens]
"""
from __future__ import annotations

import sys

from tqdm import tqdm

import mtpflow
from mtpflow_plugin_example import suffix

REQUESTS = [  # (first request, a similar one)
    ("List three uses of a paper clip, one per line.", "List three uses of a paper clip, one per line, briefly."),
    ("Write a Python function that returns the factorial of n.",
     "Write a Python function that returns the factorial of a number n."),
    ("Explain what a hash table is in two sentences.", "Explain what a hash table is in two short sentences."),
]


def main() -> None:
    max_new = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    overrides = [f"max_new_tokens={max_new}", "trace=off"]
    pipes = {name: mtpflow.pipeline(name, overrides) for name in ("baseline", "pld")}
    pipes["suffix"] = mtpflow.pipeline("suffix", overrides, loaded=pipes["baseline"].loaded)
    rows = []
    suffix.HISTORIES.clear()
    jobs = [(p, s) for p, s in REQUESTS]
    for first, similar in tqdm(jobs, desc="requests"):
        base = pipes["baseline"](first)
        pld = pipes["pld"](first)
        runs = {"suffix, first time": pipes["suffix"](first), "suffix, same again": pipes["suffix"](first),
                "suffix, similar": pipes["suffix"](similar)}
        rows.append(("baseline", base.stats, base.stats))
        rows.append(("pld", pld.stats, base.stats))
        rows += [(label, r.stats, base.stats) for label, r in runs.items()]
        assert runs["suffix, same again"].token_ids == base.token_ids == runs["suffix, first time"].token_ids
    print(f"\n{'run':<20} {'tokens':>6} {'MAL':>6} {'accepted':>8} {'speed vs baseline':>18}")
    for label, s, b in rows:
        speed = s["tokens_per_second"] / b["tokens_per_second"] if b["tokens_per_second"] else 0.0
        print(f"{label:<20} {s['new_tokens']:>6} {s['mal']:>6.2f} {s['accepted_tokens']:>8} {speed:>17.2f}x")


if __name__ == "__main__":
    main()
