"""Fused q/k/v and gate/up products (``cpu_linear.FusedLinear``) against the parts apart, in one process,
interleaved.

    python scripts/fused_projections_ab.py            # one sequence, one-row steps
    python scripts/fused_projections_ab.py 16         # 16 sequences in one batched step
    python scripts/fused_projections_ab.py 1 9        # one sequence verifying 9 rows (root + an 8-token chain)
    python scripts/fused_projections_ab.py 16 1 native,native,native,native,native,packed,packed   # force plans

Each sequence holds a 150-token random prompt in the engine's KV pool; a step is one verify forward, rolled back
after timing. Six rounds of 12 steps each way (after 3 warm-up steps), switching by ``FusedLinear.ready``;
prints the median and 25th percentile per way.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from mtpflow.engine import Engine
from mtpflow.kernels import cpu_linear
from mtpflow.kernels.dispatch import use_backend
from mtpflow.target import Target, verify_batch
from mtpflow.types import Draft


def main(batch: int = 1, rows: int = 1, plans: str | None = None, rounds: int = 6, steps: int = 12) -> None:
    engine = Engine.from_overrides(["trace=off", f"max_batch_size={batch}"])
    model = engine.loaded.model
    if plans:
        cpu_linear.apply_plans(model, tuple(plans.split(",")))
    g = torch.Generator().manual_seed(0)
    ready = cpu_linear.FusedLinear.ready
    times: dict[bool, list[float]] = {True: [], False: []}
    with use_backend("auto"), cpu_linear.packed(engine.packed_linear), torch.inference_mode():
        targets = [Target(model, pool=engine.pool) for _ in range(batch)]
        for t in targets:
            t.prefill(torch.randint(100, 40000, (150,), generator=g))
        draft = Draft.chain(torch.randint(100, 40000, (rows - 1,), generator=g))
        lengths = [t.cache_len for t in targets]

        def step():
            if batch == 1:
                targets[0].verify(5, draft, lengths[0])
            else:
                verify_batch(model, targets, [5] * batch, [draft] * batch, lengths)
            for t, n in zip(targets, lengths):
                t.cache_len = n

        try:
            for _ in range(rounds):
                for fused in (True, False):
                    cpu_linear.FusedLinear.ready = ready if fused else (lambda self: False)
                    for _ in range(3):
                        step()
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        step()
                        times[fused].append(time.perf_counter() - t0)
        finally:
            cpu_linear.FusedLinear.ready = ready
    print(f"plans {model._mtpflow_linear_plans}, fused products {getattr(model, '_mtpflow_fused', 0)}")
    for fused, v in times.items():
        print(f"batch {batch}, {rows} row(s) per sequence, {'fused' if fused else 'apart'}: median "
              f"{1e3 * statistics.median(v):.1f} ms, p25 {1e3 * sorted(v)[len(v) // 4]:.1f} ms")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 1, int(args[1]) if len(args) > 1 else 1, args[2] if len(args) > 2 else None)
