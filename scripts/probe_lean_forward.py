"""One verify-forward path against another, in one process, interleaved.

    python scripts/probe_lean_forward.py              # lean forward vs HF's forward, one sequence, one-row steps
    python scripts/probe_lean_forward.py 16           # ... 16 sequences in one batched step
    python scripts/probe_lean_forward.py 1 row        # mtpflow_llama_rows vs the lean forward's layers
                                                      #   (MTPFLOW_NATIVE_ROW=1 / 0)
    MTPFLOW_PROBE_SOURCE=old.c python scripts/probe_lean_forward.py 1 kernel
                                                      # this checkout's small_gemm.c vs another version of it
                                                      #   (e.g. git show HEAD~1:mtpflow/kernels/small_gemm.c > old.c)
    python scripts/probe_lean_forward.py 16 fused     # fused q/k/v and gate/up products vs the parts apart
    python scripts/probe_lean_forward.py 1 fused 9    # one sequence verifying 9 rows (root + an 8-token chain)
    python scripts/probe_lean_forward.py 16 fused 1 native,native,native,native,native,packed,packed   # plans

``lean`` and ``fused`` run with ``MTPFLOW_NATIVE_ROW=0`` (they compare ways of running the layers in Python). Each
sequence holds a 120-token random prompt in the engine's KV pool; a step is one verify forward (through
``verify_batch``, as the engine runs it), rolled back after timing. Six rounds of 15 steps each way (after 3
warm-up steps); prints the median and 25th percentile per way.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from mtpflow.engine import Engine
from mtpflow.kernels import cpu_linear, native_linear
from mtpflow.kernels.dispatch import use_backend
from mtpflow.target import Target, verify_batch
from mtpflow.types import Draft

NAMES = {"lean": ("lean forward", "HF forward"), "row": ("native rows", "lean layers"), "fused": ("fused", "apart"),
         "kernel": ("this small_gemm.c", "MTPFLOW_PROBE_SOURCE")}


def other_build():
    """The kernels built from MTPFLOW_PROBE_SOURCE (``kernel``: another version of small_gemm.c)."""
    import tempfile
    from pathlib import Path

    out = Path(tempfile.mkdtemp()) / "other.so"
    if not native_linear.build(native_linear.compiler(), out, source=Path(os.environ["MTPFLOW_PROBE_SOURCE"])):
        raise SystemExit("cannot build MTPFLOW_PROBE_SOURCE")
    return native_linear.load(out)


def switch(model, what: str, on: bool, ready=cpu_linear.FusedLinear.ready, libs=None) -> None:
    """Turn path ``what`` on or off for the next steps."""
    if what == "kernel":  # forward.native_rows and the LM head's native linear look the library up per call
        native_linear.library = libs[0] if on else libs[1]
    elif what == "lean":
        model._mtpflow_lean = on  # the flag mtpflow.forward.supports caches
    elif what == "row":
        os.environ["MTPFLOW_NATIVE_ROW"] = "1" if on else "0"  # read per forward
    else:
        cpu_linear.FusedLinear.ready = ready if on else (lambda self: False)


def main(batch: int = 1, what: str = "lean", rows: int = 1, plans: str | None = None, rounds: int = 6,
         steps: int = 15) -> None:
    libs = None
    if what == "kernel":
        this, other = native_linear.library(), other_build()
        libs = (lambda: this, lambda: other)
    elif what != "row":  # the lean forward's layers in Python, where the fused products and HF's forward differ
        os.environ["MTPFLOW_NATIVE_ROW"] = "0"
    engine = Engine.from_overrides(["trace=off", f"max_batch_size={batch}"])
    model = engine.loaded.model
    if plans:
        cpu_linear.apply_plans(model, tuple(plans.split(",")))
    g = torch.Generator().manual_seed(0)
    times: dict[bool, list[float]] = {True: [], False: []}
    with use_backend("auto"), cpu_linear.packed(engine.packed_linear), torch.inference_mode():
        targets = [Target(model, pool=engine.pool) for _ in range(batch)]
        for t in targets:
            t.prefill(torch.randint(100, 40000, (120,), generator=g))
        draft = Draft.chain(torch.randint(100, 40000, (rows - 1,), generator=g))
        lengths = [t.cache_len for t in targets]

        def step():
            verify_batch(model, targets, [5] * batch, [draft] * batch, lengths)
            for t, n in zip(targets, lengths):
                t.cache_len = n

        try:
            for _ in range(rounds):
                for on in (True, False):
                    switch(model, what, on, libs=libs)
                    for _ in range(3):
                        step()
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        step()
                        times[on].append(time.perf_counter() - t0)
        finally:
            switch(model, what, True, libs=libs)
    print(f"plans {model._mtpflow_linear_plans}, fused products {getattr(model, '_mtpflow_fused', 0)}")
    for on, v in times.items():
        print(f"batch {batch}, {rows} row(s) per sequence, {NAMES[what][0 if on else 1]}: median "
              f"{1e3 * statistics.median(v):.2f} ms, p25 {1e3 * sorted(v)[len(v) // 4]:.2f} ms")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 1, args[1] if len(args) > 1 else "lean",
         int(args[2]) if len(args) > 2 else 1, args[3] if len(args) > 3 else None)
