"""The native logit statistics alone against torch's three passes (argmax, logsumexp, topk(8)) over random logits
[rows, 49152] (the default model's vocabulary), 2 threads, mean of 300 calls after 20 warm-up calls:

    python docs/bench/verify_cost_dec06/micro_logit_stats.py
"""
import time

import torch

from mtpflow.backends.native import kernel


def mean_us(f, calls: int = 300) -> float:
    for _ in range(20):
        f()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls * 1e6


if __name__ == "__main__":
    torch.set_num_threads(2)
    for rows in (1, 9, 13):
        x = torch.randn(rows, 49152) * 3
        torch_passes = lambda: (x.argmax(-1), torch.logsumexp(x, -1), x.topk(8, dim=-1))  # noqa: E731
        print(f"torch argmax+lse+topk8 {rows} {mean_us(torch_passes):.0f} us")
        print(f"native top8 {rows} {mean_us(lambda: kernel.logit_stats(x, 2, top=8)):.0f} us")
        print(f"native no-top {rows} {mean_us(lambda: kernel.logit_stats(x, 2)):.0f} us")
