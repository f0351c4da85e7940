"""In-process A/B of the int8 weights on huge pages (memory.streamed_empty) against the same bytes on 4 KB pages.

One process loads the int8 model (its weights land on huge pages where the system grants them), copies the weight
buffer once into plain torch.empty memory, and alternates the kernel between the two copies: rounds of 30 timed
verify forwards at K = 0 (a decode step) and K = 8 (a chain of 8 drafts), 256-token context, the order of the two
sides flipped every round. It also reads the memory bandwidth as int8_bench does (torch.sum over 1 GiB of float32)
over a buffer on 4 KB pages and one on huge pages, fastest of 5 each.

    python docs/bench/huge_pages_dec06/ab_huge_pages.py [rounds]
"""
import statistics
import sys
import time

import torch

from mtpflow import backends
from mtpflow.backends.native import kernel
from mtpflow.backends.native.memory import huge_page_bytes, streamed_empty
from mtpflow.model import load_model
from mtpflow.target import Target
from mtpflow.types import Draft


def bandwidth(data: torch.Tensor, repeats: int = 5) -> float:
    data.sum()
    best = min(_timed(data.sum) for _ in range(repeats))
    return data.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(rounds: int) -> None:
    torch.set_num_threads(2)
    loaded = load_model(quantize="int8", dtype="float32")
    backend = backends.create(loaded.model, "native_cpu", int8=loaded.int8)
    w = backend.w
    lins = [getattr(layer, name) for layer in w.layers for name in ("qkv", "o", "gate_up", "down")] + [w.head]
    plain = w.buffer.clone()  # torch.empty's memory: 4 KB pages
    base = w.buffer.data_ptr()
    views = {id(x): (x, x.q, plain[x.q.data_ptr() - base:][:x.q.numel()].view(x.q.shape)) for x in lins}
    print(f"weights {w.buffer.numel() / 2**20:.1f} MiB, on huge pages {huge_page_bytes(w.buffer) / 2**20:.1f} MiB; "
          f"the 4 KB copy {huge_page_bytes(plain) / 2**20:.1f} MiB", flush=True)

    def use(huge: bool) -> None:
        for x, q_huge, q_plain in views.values():
            x.q = q_huge if huge else q_plain
        for key, name in (("qkv", "qkv"), ("o", "o"), ("gu", "gate_up"), ("d", "down")):
            backend._arrays["w" + key] = kernel.pointers([getattr(layer, name).q for layer in w.layers])

    g = torch.Generator().manual_seed(0)
    target = Target(backend)
    target.argmax_only = True
    target.prefill(torch.randint(0, w.head.n, (256,), generator=g))
    start = target.cache_len
    drafts = {k: Draft.chain(torch.randint(0, w.head.n, (k,), generator=g)) for k in (0, 8)}
    res: dict = {}
    for rnd in range(rounds):
        for huge in ((False, True) if rnd % 2 else (True, False)):
            use(huge)
            for k in (0, 8):
                for i in range(33):
                    if i == 3:
                        t0 = time.perf_counter()
                    target.cache_len = start
                    target.verify(1, drafts[k], root_position=start)
                res.setdefault((huge, k), []).append(1000 * (time.perf_counter() - t0) / 30)
    print("| weights on | K=0 fastest / median ms | K=8 fastest / median ms | K=8 / K=0 (fastest) |")
    print("|---|---|---|---|")
    for huge in (False, True):
        r0, r8 = res[(huge, 0)], res[(huge, 8)]
        print(f"| {'huge pages' if huge else '4 KB pages'} | {min(r0):.3f} / {statistics.median(r0):.3f} | "
              f"{min(r8):.3f} / {statistics.median(r8):.3f} | {min(r8) / min(r0):.3f} |")
    for k in (0, 8):
        print(f"K={k}: 4 KB / huge, fastest {min(res[(False, k)]) / min(res[(True, k)]):.3f}x, median "
              f"{statistics.median(res[(False, k)]) / statistics.median(res[(True, k)]):.3f}x")
    del views, plain
    n = 2**30 // 4
    for label, data in (("4 KB pages", torch.ones(n)), ("huge pages", streamed_empty(n, torch.float32).fill_(1.0))):
        print(f"torch.sum over 1 GiB, {label}: {bandwidth(data):.1f} GB/s "
              f"({huge_page_bytes(data) / 2**20:.0f} MiB on huge pages)", flush=True)
        del data


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
