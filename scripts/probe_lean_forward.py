"""The lean Llama forward (mtpflow/forward.py) against the model's own forward, in one process, interleaved.

    python scripts/probe_lean_forward.py          # one sequence, one-row steps
    python scripts/probe_lean_forward.py 16       # 16 sequences in one batched step
    python scripts/probe_lean_forward.py 1 row    # one-row steps through mtpflow_llama_row against the lean
                                                  # forward's layers (MTPFLOW_NATIVE_ROW=1 / 0)

Each sequence holds a 120-token random prompt in the engine's KV pool; a step is one verify forward with no
draft (K = 0), rolled back after timing. Six rounds of 15 steps each way (after 3 warm-up steps), switching
the path with the model's cached ``supports`` flag (with ``row``: the ``MTPFLOW_NATIVE_ROW`` switch, read per
forward); prints the median and 25th percentile per path.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from mtpflow.engine import Engine
from mtpflow.kernels import cpu_linear
from mtpflow.kernels.dispatch import use_backend
from mtpflow.target import Target, verify_batch
from mtpflow.types import Draft


def main(batch: int = 1, what: str = "lean", rounds: int = 6, steps: int = 15) -> None:
    engine = Engine.from_overrides(["trace=off", f"max_batch_size={batch}"])
    model = engine.loaded.model
    g = torch.Generator().manual_seed(0)
    times: dict[bool, list[float]] = {True: [], False: []}
    with use_backend("auto"), cpu_linear.packed(engine.packed_linear), torch.inference_mode():
        targets = [Target(model, pool=engine.pool) for _ in range(batch)]
        for t in targets:
            t.prefill(torch.randint(100, 40000, (120,), generator=g))
        empty = Draft(tokens=torch.zeros(0, dtype=torch.long), parents=torch.zeros(0, dtype=torch.long))
        lengths = [t.cache_len for t in targets]

        def step():
            if batch == 1:
                targets[0].verify(5, empty, lengths[0])
            else:
                verify_batch(model, targets, [5] * batch, [empty] * batch, lengths)
            for t, n in zip(targets, lengths):
                t.cache_len = n

        for _ in range(rounds):
            for lean in (True, False):
                if what == "row":
                    os.environ["MTPFLOW_NATIVE_ROW"] = "1" if lean else "0"
                else:
                    model._mtpflow_lean = lean  # the flag mtpflow.forward.supports caches
                for _ in range(3):
                    step()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step()
                    times[lean].append(time.perf_counter() - t0)
    for lean, v in times.items():
        name = ("native row  " if lean else "lean layers ") if what == "row" else ("lean forward" if lean else "HF forward  ")
        print(f"batch {batch}, {name}: median {1e3 * statistics.median(v):.2f} ms, "
              f"p25 {1e3 * sorted(v)[len(v) // 4]:.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1, sys.argv[2] if len(sys.argv) > 2 else "lean")
