"""Does a thread other than the one that loaded torch run the decode's parallel work slower, and does
releasing the waiting thread's OpenMP workers fix it? (docs/benchmarks.md, "Where a decode step goes")

For each of several rounds: 60 one-row native linears (1536 x 576, 212 MB of weights: read from memory, like a
decode step) timed in the main thread, then in a fresh thread while the main thread's OpenMP workers are kept,
then in a fresh thread after the main thread released them (``mtpflow.kernels.openmp.release_workers``).
Prints the median milliseconds of each. Run: ``python scripts/probe_openmp.py [rounds]``.
"""
from __future__ import annotations

import statistics
import sys
import threading
import time

import torch

from mtpflow.kernels import native_linear, openmp


def main(rounds: int = 6) -> None:
    torch.set_num_threads(2)
    if not native_linear.available():
        sys.exit("the native kernel cannot be built here")
    weights = [torch.randn(1536, 576) for _ in range(60)]
    x = torch.randn(1, 576)

    def bench(n: int = 20) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            for w in weights:
                native_linear.linear(x, w)
                torch.nn.functional.silu(x)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def in_thread() -> float:
        out = []
        worker = threading.Thread(target=lambda: out.append(bench()))
        worker.start()
        worker.join()
        return out[0]

    results = {"main thread": [], "other thread": [], "other thread, main released": []}
    bench(3)
    for _ in range(rounds):
        results["main thread"].append(bench())
        results["other thread"].append(in_thread())
        bench(2)  # the main thread's workers are back
        openmp.release_workers()
        results["other thread, main released"].append(in_thread())
    for name, values in results.items():
        print(f"{name:30s} median {statistics.median(values):6.1f} ms   rounds: {[round(v, 1) for v in values]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
