"""The int8 products of a verify, old kernel against new, alternating: ``w8a8.c`` at REV (built aside with
``kernel.build_replacing``) against this checkout's, on random int8 weights of a model's product shapes, 1..R rows.

    python docs/bench/verify_avx2_dec07/ab_products.py REV [default|1b] [rounds]

Per row count: the fastest of ``rounds`` alternating rounds of each side's whole set of products (q, k, v, o, gate,
up, down and the head, one layer's worth each), ms, and the ratio to one row on the same side.
"""
import subprocess, sys, tempfile, time
from pathlib import Path
import torch
from mtpflow.backends.native import kernel, products
from mtpflow.backends.native import int8_reference as R

rev, shape = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "default")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
old_text = subprocess.run(["git", "show", f"{rev}:mtpflow/backends/native/w8a8.c"], capture_output=True, text=True,
                          check=True).stdout
out = Path(tempfile.mkdtemp()) / "old.so"
assert kernel.build_replacing(out, "w8a8.c", old_text), "the old build failed"
libs = {"old": kernel.load(out), "new": kernel.library()}
H, I, V = {"default": (576, 1536, 49152), "1b": (2048, 8192, 128256)}[shape]
# one layer's products and the head: (outputs, inputs)
shapes = [(H + 2 * (H // 3), H), (H, H), (2 * I, H), (H, I), (V, H)] if shape == "default" else \
         [(H + 2 * 512, H), (H, H), (2 * I, H), (H, I)]
torch.manual_seed(0)
weights = [R.Int8Linear.of(torch.randn(n, k)) for n, k in shapes]
threads = torch.get_num_threads()
rows_list = (1, 2, 3, 4, 5, 7, 9, 13, 17)
best = {(side, m): float("inf") for side in libs for m in rows_list}
for r in range(rounds):
    for m in rows_list:
        xs = [torch.randn(m, k) for _, k in shapes]
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            t = time.perf_counter()
            for x, lin, (n, k) in zip(xs, weights, shapes):
                products.gemm_w8a8(x, lin.q, lin.scale, lin.wsum, k, lib=libs[side])
            best[side, m] = min(best[side, m], time.perf_counter() - t)
print(f"{shape} shape, {threads} threads, {kernel.q8_isa()}; old = w8a8.c at {rev}")
print("rows  old ms  (x 1 row)  new ms  (x 1 row)  new/old")
for m in rows_list:
    o, n = best["old", m] * 1e3, best["new", m] * 1e3
    print(f"{m:4d} {o:7.2f}  ({o / (best['old', 1] * 1e3):4.2f}x)  {n:7.2f}  ({n / (best['new', 1] * 1e3):4.2f}x)  {n / o:5.3f}")
