"""The int8 model's product (products.gemm_w8a8) alone at 1, 4, 9, 12 and 13 rows: a small weight that stays in cache
and the LM head's (49152 x 576, streamed): ms, multiply-adds per second and weight bytes per second, the fastest of 5.

    python docs/bench/step_dec06/product_rows.py
"""
import time, torch, sys
from mtpflow.backends.native import products as P
torch.set_num_threads(2)
def prep(n, k):
    w = torch.randn(n, k)
    q, s = P.quantize_int8(w)
    return P.pack_q8(q), s, q.sum(1, dtype=torch.int32).to(torch.int32), k
cases = {"hot 1536x576": prep(1536, 576), "lm 49152x576": prep(49152, 576), "mid 6144x576": prep(6144, 576)}
for name, c in cases.items():
    pk, s, ws, k = c
    for M in (1, 4, 9, 12, 13):
        x = torch.randn(M, k)
        for _ in range(3): P.gemm_w8a8(x, pk, s, ws, k)
        reps = max(3, int(2e9 / (M * pk.numel() + 1e8)))
        best = 1e9
        for r in range(5):
            t = time.perf_counter()
            for _ in range(reps): P.gemm_w8a8(x, pk, s, ws, k)
            best = min(best, (time.perf_counter() - t) / reps)
        macs = M * s.numel() * k
        print(f"{name:18s} M={M:2d} {best*1e3:7.3f} ms  {macs/best/1e9:6.1f} GMAC/s  {pk.numel()/best/1e9:5.1f} GB/s")
