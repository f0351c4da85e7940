"""Two builds of ``mtpflow/kernels/small_gemm.c`` inside whole batched verify forwards of the default model, in
one process, interleaved: the A build and the B build take turns on the same drafts over the same KV caches
(the ``native_cpu`` backend's ``verify``, its ``mtpflow_llama_rows`` call and products from each build), best of 8
per (sequences, rows), and the largest logit difference between them.

    git show HEAD~1:mtpflow/kernels/small_gemm.c > /tmp/before.c
    python scripts/native_rows_ab.py /tmp/before.c mtpflow/kernels/small_gemm.c [CONTEXT]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from mtpflow.config import compose
from mtpflow.engine import Engine
from mtpflow.kernels import native_linear
from mtpflow.kernels.dispatch import use_backend
from mtpflow.kv_cache import KVPool
from mtpflow.target import Target
from mtpflow.types import Draft


def main(source_a: str, source_b: str, context: int = 128) -> None:
    libs = []
    for i, source in enumerate((source_a, source_b)):
        out = Path(f"/tmp/mtpflow_native_ab_{i}.so")
        if not native_linear.build(native_linear.compiler(), out, source=Path(source)):
            raise SystemExit(f"cannot build {source}")
        libs.append(native_linear.load(out))
    engine = Engine(compose(["strategy=baseline", "trace=off", "max_batch_size=16", "prefix_cache_mb=0",
                             "model.backend=native_cpu"]))
    backend, model = engine.backend, engine.loaded.model
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    try:
        with use_backend("auto"), backend.running(), torch.inference_mode():
            for b in (1, 4, 16):
                pool = KVPool(model, b)
                targets = [Target(backend, pool=pool) for _ in range(b)]
                for t in targets:
                    t.prefill(torch.randint(0, vocab, (context,), generator=g))
                for q in (1, 3):
                    best, logits = [1e9, 1e9], [None, None]
                    for _ in range(8):
                        for w in (0, 1):
                            backend.lib = libs[w]  # every native call of the backend: the rows and the products
                            drafts = [Draft.chain(torch.arange(1, q)) for _ in targets]
                            t0 = time.perf_counter()
                            out = backend.verify(targets, [1] * b, drafts, [context] * b)
                            best[w] = min(best[w], time.perf_counter() - t0)
                            logits[w] = out[0].logits
                            for t in targets:
                                t.cache_len = context
                    diff = (logits[0] - logits[1]).abs().max().item()
                    print(f"{b:2d} sequences x {q} rows: A {best[0] * 1e3:6.1f} ms  B {best[1] * 1e3:6.1f} ms  "
                          f"B/A {best[1] / best[0]:.3f}  largest logit difference {diff:.1e}", flush=True)
                for t in targets:
                    t.release()
    finally:
        backend.lib = native_linear.library()
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 128)
