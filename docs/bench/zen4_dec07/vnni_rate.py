"""The int8 products' arithmetic rate on this host, weights in cache: one [N, 576] product over M rows, 100 calls a
round, fastest of 30 rounds; vpdpbusd count = N * 576 * M / 64, per core (2 threads). Each call's OpenMP fork and
join and its quantized activations are in the time, so the rate is a lower bound on the instruction's own.

    python docs/bench/zen4_dec07/vnni_rate.py
"""
import time, torch
from mtpflow.backends.native import products, kernel
from mtpflow.backends.native import int8_reference as R
torch.manual_seed(0)
print(kernel.q8_isa(), torch.get_num_threads(), "threads")
for n in (1536, 3072):
    lin = R.Int8Linear.of(torch.randn(n, 576))
    for m in (1, 2, 4, 8, 9, 12):
        x = torch.randn(m, 576)
        for _ in range(100): products.gemm_w8a8(x, lin.q, lin.scale, lin.wsum, 576)
        best = 1e9
        for _ in range(30):
            t = time.perf_counter()
            for _ in range(100): products.gemm_w8a8(x, lin.q, lin.scale, lin.wsum, 576)
            best = min(best, (time.perf_counter() - t) / 100)
        print(f"N={n:5d} M={m:2d} {best*1e6:7.1f} us  {n*576*m/64/best/2/1e9:5.2f} G vpdpbusd/s/core")
