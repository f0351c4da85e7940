"""One verify-forward path against another, in one process, interleaved.

    python scripts/probe_lean_forward.py              # hf backend: lean forward vs HF's forward, one sequence,
                                                      #   one-row steps (MTPFLOW_LEAN_FORWARD=1 / 0)
    python scripts/probe_lean_forward.py 16           # ... 16 sequences in one batched step
    python scripts/probe_lean_forward.py 1 row        # native_cpu backend: mtpflow_llama_rows vs the lean
                                                      #   forward's layers with the backend's native products
    MTPFLOW_PROBE_SOURCE=old.c python scripts/probe_lean_forward.py 1 kernel
                                                      # this checkout's small_gemm.c vs another version of it
                                                      #   (e.g. git show HEAD~1:mtpflow/kernels/small_gemm.c > old.c)
    python scripts/probe_lean_forward.py 16 fused     # fused q/k/v and gate/up products vs the parts apart
    python scripts/probe_lean_forward.py 1 fused 9    # one sequence verifying 9 rows (root + an 8-token chain)

``fused`` runs the lean forward's layers in Python with the ``native_cpu`` backend's products (it compares ways of
running the products, not the rows). Each sequence holds a 120-token random prompt in the engine's KV pool; a step
is one verify forward (the backend's ``verify`` over all sequences, as the engine runs it), rolled back after
timing. Six rounds of 15 steps each way (after 3 warm-up steps); prints the median and 25th percentile per way.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from mtpflow.backends import HFBackend
from mtpflow.backends import native_cpu
from mtpflow.engine import Engine
from mtpflow.kernels import native_linear
from mtpflow.kernels.dispatch import use_backend
from mtpflow.target import Target
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


def main(batch: int = 1, what: str = "lean", rows: int = 1, rounds: int = 6, steps: int = 15) -> None:
    if what not in NAMES:
        raise SystemExit(f"unknown comparison {what!r}: one of {', '.join(NAMES)}")
    backend_name = "hf" if what == "lean" else "native_cpu"
    engine = Engine.from_overrides(["trace=off", f"max_batch_size={batch}", f"model.backend={backend_name}"])
    backend, model = engine.backend, engine.loaded.model
    libs = (native_linear.library(), other_build()) if what == "kernel" else None
    ready = native_cpu._Fused.ready

    def switch(on: bool) -> None:
        """Turn path ``what`` on or off for the next steps."""
        if what == "kernel":  # the backend looks its library up per call: the rows and every product
            backend.lib = libs[0] if on else libs[1]
        elif what == "lean":
            os.environ["MTPFLOW_LEAN_FORWARD"] = "1" if on else "0"  # read per forward (mtpflow.forward.supports)
        elif what == "fused":
            native_cpu._Fused.ready = ready if on else (lambda self: False)

    def verify(on: bool):
        """The backend's own verify, except where the way compared is one of the lean forward's layers."""
        if what == "fused" or (what == "row" and not on):
            return lambda *args: HFBackend.verify(backend, *args)  # the layers in Python, the backend's products
        return backend.verify

    g = torch.Generator().manual_seed(0)
    times: dict[bool, list[float]] = {True: [], False: []}
    with use_backend("auto"), backend.running(), torch.inference_mode():
        targets = [Target(backend, pool=engine.pool) for _ in range(batch)]
        for t in targets:
            t.prefill(torch.randint(100, 40000, (120,), generator=g))
        draft = Draft.chain(torch.randint(100, 40000, (rows - 1,), generator=g))
        lengths = [t.cache_len for t in targets]

        def step(run):
            run(targets, [5] * batch, [draft] * batch, lengths)
            for t, n in zip(targets, lengths):
                t.cache_len = n

        try:
            for _ in range(rounds):
                for on in (True, False):
                    switch(on)
                    run = verify(on)
                    for _ in range(3):
                        step(run)
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        step(run)
                        times[on].append(time.perf_counter() - t0)
        finally:
            switch(True)
            engine.close()
    print(f"backend {backend.describe()}")
    for on, v in times.items():
        print(f"batch {batch}, {rows} row(s) per sequence, {NAMES[what][0 if on else 1]}: median "
              f"{1e3 * statistics.median(v):.2f} ms, p25 {1e3 * sorted(v)[len(v) // 4]:.2f} ms")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 1, args[1] if len(args) > 1 else "lean", int(args[2]) if len(args) > 2 else 1)
