"""CPU A/B of the kernel dispatch layer: the decode benchmark's prompts through baseline and pld with the
``kernels=torch`` path (the dispatchers in front of the references) against the code before it (PLD and the
gate calling the torch code directly), alternating A and B per prompt in one process so machine load hits
both alike.

    python scripts/kernels_cpu_ab.py --limit 2 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from tqdm import tqdm


@contextlib.contextmanager
def old_path():
    """Swap in the pre-kernels functions: PLD's n-gram loop and the gate's direct reference call."""
    import mtpflow.strategies.gates as gates
    import mtpflow.strategies.pld as pld
    from mtpflow.kernels.ngram import ngram_continuation_reference
    from mtpflow.kernels.tree_verify import greedy_tree_verify_reference

    saved = pld.ngram_continuation, gates.greedy_tree_verify
    pld.ngram_continuation = lambda c, lo, hi, k, backend=None: ngram_continuation_reference(c, lo, hi, k)
    gates.greedy_tree_verify = greedy_tree_verify_reference
    try:
        yield
    finally:
        pld.ngram_continuation, gates.greedy_tree_verify = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=2, help="prompts per class")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--strategies", default="baseline,pld")
    parser.add_argument("--micro-only", action="store_true", help="only the n-gram micro-benchmark")
    args = parser.parse_args()
    if args.micro_only:
        micro()
        return
    from mtpflow.api import pipeline
    from mtpflow.tools.bench import load_prompt_suite

    suite = load_prompt_suite(limit=args.limit)
    common = [f"max_new_tokens={args.max_new_tokens}", "kernels=torch"]
    pipes = {s: pipeline(s, common) for s in args.strategies.split(",")}
    warm = next(iter(pipes.values())).encode("Hello")
    for p in pipes.values():
        p(prompt_ids=warm)
    seconds = {(s, v): [] for s in pipes for v in ("before", "kernels=torch")}
    same = True
    for i, item in enumerate(tqdm(suite, desc="A/B", unit="prompt")):
        for name, pipe in pipes.items():
            ids = pipe.encode(item["prompt"])
            order = ("before", "kernels=torch") if i % 2 == 0 else ("kernels=torch", "before")
            tokens = {}
            for variant in order:
                ctx = old_path() if variant == "before" else contextlib.nullcontext()
                with ctx:
                    t0 = time.perf_counter()
                    tokens[variant] = pipe(prompt_ids=ids).token_ids
                    seconds[name, variant].append(time.perf_counter() - t0)
            same &= tokens["before"] == tokens["kernels=torch"]
    print(f"{'strategy':<10} {'variant':<15} {'total s':>9} {'median s':>9}")
    for (name, variant), xs in seconds.items():
        print(f"{name:<10} {variant:<15} {sum(xs):9.2f} {statistics.median(xs):9.3f}")
    for name in pipes:
        ratio = sum(seconds[name, "kernels=torch"]) / sum(seconds[name, "before"])
        print(f"{name}: kernels=torch / before = {ratio:.3f}")
    print("identical tokens:", same)
    micro()


def micro(repeats: int = 2000) -> None:
    """The n-gram match alone on a PLD-sized history: the reference called directly, through the dispatcher,
    and the kernel's algorithm in torch (for information)."""
    from mtpflow.kernels import ngram_continuation
    from mtpflow.kernels.ngram import ngram_continuation_reference, ngram_continuation_vectorised

    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, 400, (300,), generator=g)
    context[-3:] = context[100:103]
    for name, fn in (("reference, direct (before)", ngram_continuation_reference),
                     ("dispatcher, kernels=torch", lambda *a: ngram_continuation(*a, backend="torch")),
                     ("kernel algorithm in torch", ngram_continuation_vectorised)):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn(context, 1, 3, 8)
        print(f"n-gram match over {context.numel()} tokens, {name}: {(time.perf_counter() - t0) / repeats * 1e6:.0f} us")


if __name__ == "__main__":
    main()
