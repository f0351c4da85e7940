"""Where a CPU decode step's time goes, per weight format: times the default model's linear shapes (the
576 x 49152 LM head, the 576 -> 1536 and 1536 -> 576 MLP projections) at 1, 8 and 32 rows in float32, bfloat16,
float16, int8 weight-only (``torch._weight_int8pack_mm``) and int8 dynamic quantization (fbgemm, activations
quantized per tensor), and checks whether a row's result depends on the other rows in the call (it must not,
for a verify forward of many rows to give what one row alone gives).

    python scripts/probe_linears.py            # 2 threads, as the benchmarks run

Findings on the 2-core AMD EPYC host (2026-12-02) are in docs/benchmarks.md ("Where a decode step goes").
"""
from __future__ import annotations

import time
import warnings

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(2)
SHAPES = ((49152, 576, "lm_head"), (1536, 576, "mlp-up"), (576, 1536, "mlp-down"))


def timed(fn, n: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    from torch.ao.quantization import quantize_dynamic

    print("shape     rows  fp32 us  bf16 us  fp16 us  w8-only us  int8-dyn us  int8-dyn rows independent")
    for n_out, n_in, name in SHAPES:
        w = torch.randn(n_out, n_in)
        scales = w.abs().amax(1) / 127
        wq = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        lin = torch.nn.Linear(n_in, n_out, bias=False)
        lin.weight.data = w
        dyn = quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
        reps = 20 if n_out > 10000 else 200
        for rows in (1, 8, 32):
            x = torch.randn(rows, n_in)
            row = []
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                xd, wd = x.to(dt), w.to(dt)
                row.append(timed(lambda: torch.nn.functional.linear(xd, wd), reps))
            row.append(timed(lambda: torch._weight_int8pack_mm(x, wq, scales), max(3, reps // 10)))
            row.append(timed(lambda: dyn(x), reps))
            independent = rows == 1 or torch.equal(dyn(x[:1]), dyn(x)[:1])
            print(f"{name:9s} {rows:4d}" + "".join(f" {1e6 * s:8.0f}" for s in row[:3])
                  + f" {1e6 * row[3]:11.0f} {1e6 * row[4]:12.0f}  {independent}")


if __name__ == "__main__":
    main()
