"""In-process A/B of whole native source trees on a random Llama of ``tune shape=`` size, int8: the model is built
and quantized once (as ``mtpflow.tools.tune_shape`` does), each tree built into its own library with its own KV pool
prefilled with CONTEXT random tokens, then ROUNDS rounds alternating the trees (the order reversed every other
round), 10 timed verify forwards (after 2 untimed) per draft length. Prints each tree's fastest and median ms per
K and, per K, the median over the rounds of each tree over the first.

    python docs/bench/step_dec06b/ab_shape.py SHAPE ROUNDS CONTEXT K,K,... NAME=REV NAME=REV ...

REV is a commit, or ``work`` for the working tree (docs/bench/step_dec06/ab_tree.py has the builds).
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "step_dec06"))
from ab_tree import source_tree  # noqa: E402

from mtpflow import backends  # noqa: E402
from mtpflow.backends.native import kernel  # noqa: E402
from mtpflow.target import Target  # noqa: E402
from mtpflow.tools.tune_shape import COMMON, SHAPES  # noqa: E402
from mtpflow.types import Draft  # noqa: E402


def main(shape: str, rounds: int, context: int, ks: list[int], specs: dict[str, str]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp())
    libs = {}
    for name, rev in specs.items():
        folder = source_tree(rev, root / name)
        out = root / name / "kernel.so"
        if not kernel.build(kernel.compiler(), out, kernel.FLAGS, tuple(folder / p.name for p in kernel.SOURCES)):
            sys.exit(f"the {name} build failed")
        libs[name] = kernel.load(out)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as tune_shape builds a model whose float32 copy would not fit
    try:
        with torch.no_grad():
            model = LlamaForCausalLM(LlamaConfig(**{**SHAPES[shape], **COMMON})).eval()
    finally:
        torch.set_default_dtype(default)
    backend = backends.create(model, int8=backends.quantize_int8(model))
    g = torch.Generator().manual_seed(0)
    vocab = backend.w.head.n
    prompt = torch.randint(0, vocab, (context,), generator=g)
    targets = {}
    with backend.running(), torch.inference_mode():
        for name, lib in libs.items():
            backend.lib = lib
            targets[name] = Target(backend, pool=backend.make_pool(1))
            targets[name].argmax_only = True
            targets[name].prefill(prompt)
        start = targets[name].cache_len
        drafts = {k: Draft.chain(torch.randint(0, vocab, (k,), generator=g)) for k in ks}
        times: dict[tuple[str, int], list[float]] = {}
        for rnd in range(rounds):
            for name in (list(libs) if rnd % 2 == 0 else list(libs)[::-1]):
                backend.lib, target = libs[name], targets[name]
                for k, draft in drafts.items():
                    for i in range(12):
                        if i == 2:
                            t0 = time.perf_counter()
                        target.cache_len = start
                        target.verify(1, draft, root_position=start)
                    times.setdefault((name, k), []).append(1000 * (time.perf_counter() - t0) / 10)
    print(f"shape {shape}, int8, context {context}, {rounds} rounds; ms fastest / median")
    for name in libs:
        print(f"{name:>8}  " + "   ".join(
            f"K={k} {min(times[(name, k)]):7.2f} / {statistics.median(times[(name, k)]):7.2f}" for k in ks))
        k0 = times[(name, ks[0])]
        print(" " * 10 + "   ".join(f"K={k} / K={ks[0]} per round {statistics.median(b / a for a, b in zip(k0, times[(name, k)])):.2f}"
                                    for k in ks[1:]))
    first = next(iter(specs))
    for k in ks:
        print(f"K={k}: " + ", ".join(
            f"{name} / {first} {statistics.median(b / a for a, b in zip(times[(first, k)], times[(name, k)])):.3f}"
            for name in specs if name != first), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), [int(x) for x in a[3].split(",")], dict(x.split("=", 1) for x in a[4:]))
