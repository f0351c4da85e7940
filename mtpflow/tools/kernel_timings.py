"""Time every draft-tree kernel against its torch reference at decode-time sizes (SmolLM2-135M: vocab 49152,
9 query heads over 3 KV heads of dim 64) and write a markdown table. On CUDA it times the Triton kernels (and
checks each result against the reference first); elsewhere it times the references only.

    python -m mtpflow.tools.kernel_timings --out gpu-check/kernel_timings.md
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

import torch


def timed(fn, repeats: int, sync) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def cases(device: torch.device, vocab: int = 49152):
    """(name, size, call(impl)) per kernel, inputs built once on ``device``."""
    from mtpflow import kernels

    g = torch.Generator(device="cpu").manual_seed(0)
    nodes = 64
    parents = torch.tensor([-1] + [max(-1, (i - 1) // 2) for i in range(1, nodes)])  # a binary tree
    argmax = torch.randn(nodes + 1, vocab, generator=g).argmax(-1).to(device)
    tokens = argmax[(parents + 1).to(device)].cpu()
    p = (torch.randn(9, vocab, generator=g) * 3).softmax(-1).to(device)
    q = (torch.randn(8, vocab, generator=g) * 3).softmax(-1).to(device)
    chain = torch.multinomial(q.cpu(), 1, generator=g).flatten().to(device)
    uniforms = torch.rand(9, generator=g).to(device)
    node_probs = torch.rand(nodes, generator=g).to(device)
    history = torch.randint(0, 500, (2048,), generator=g).to(device)
    history[-3:] = history[1000:1003]
    prefix, nq = 1024, 16
    qh = torch.randn(1, 9, nq, 64, generator=g).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    kh = torch.randn(1, 3, prefix + nq, 64, generator=g).to(device, qh.dtype)
    vh = torch.randn(1, 3, prefix + nq, 64, generator=g).to(device, qh.dtype)
    allowed = torch.ones(1, nq, nq, dtype=torch.bool, device=device).tril()
    return [
        ("greedy tree verify (path)", f"{nodes} nodes",
         lambda b: kernels.greedy_tree_verify(argmax, tokens, parents, impl=b)),
        ("speculative accept + residual sample", f"chain 8 x {vocab}, drafted from q",
         lambda b: kernels.speculative_accept(p, q, chain, uniforms, impl=b)),
        ("speculative accept + residual sample", f"chain 8 x {vocab}, deterministic",
         lambda b: kernels.speculative_accept(p, None, chain, uniforms, impl=b)),
        ("PFS prune", f"{nodes} nodes", lambda b: kernels.pfs_prune(node_probs, parents, 0.05, 16, impl=b)),
        ("tree attention", f"{nq} queries, {prefix} cached, 9/3 heads x 64",
         lambda b: kernels.tree_attention(qh, kh, vh, allowed, prefix, impl=b)),
        ("n-gram match", "2048 tokens, n 1..3", lambda b: kernels.ngram_continuation(history, 1, 3, 8, impl=b)),
    ]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.allclose(a.float().cpu(), b.float().cpu(), atol=2e-2, rtol=2e-2))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m mtpflow.tools.kernel_timings",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check/kernel_timings.md")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary of the probability rows")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.vocab < 2:
        parser.error("--repeats must be >= 1 and --vocab >= 2")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    lines = [f"Kernel timings, {datetime.date.today()}, {name}, torch {torch.__version__}",
             "", "| kernel | size | torch reference ms | triton ms | speedup | matches |", "|---|---|---|---|---|---|"]
    for label, size, call in cases(device, args.vocab):
        ref_ms = timed(lambda: call("torch"), args.repeats, sync)
        if device.type == "cuda":
            ok = same(call("triton"), call("torch"))
            tri_ms = timed(lambda: call("triton"), args.repeats, sync)
            lines.append(f"| {label} | {size} | {ref_ms:.3f} | {tri_ms:.3f} | {ref_ms / tri_ms:.2f}x | {ok} |")
        else:
            lines.append(f"| {label} | {size} | {ref_ms:.3f} | n/a (no CUDA) | | |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
