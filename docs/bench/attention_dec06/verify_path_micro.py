"""The Python pieces of one int8 decode step's verify path, each timed alone (mean of 2000 calls, microseconds).

The native int8 backend over the default model, one sequence after a 100-token prefill, the root alone (no
draft): ``verify_rows``, the embedding of the row (the tied int8 head's rows times their scales),
``call_members``, the ctypes struct of ``mtpflow_w8a8_rows`` built from the same members, and ``logit_stats``
over one row of logits (its C pass included). Timed alone the caches are warm; inside a step they are not (the
forward has just streamed the weights), so these are lower bounds of what the step pays.

    python docs/bench/attention_dec06/verify_path_micro.py
"""
import ctypes
import time

import torch

from mtpflow import backends
from mtpflow.backends.native import kernel, rows as R
from mtpflow.model import load_model
from mtpflow.target import Target
from mtpflow.types import Draft


def timed(name: str, fn, n: int = 2000) -> None:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    print(f"{name:>14}  {(time.perf_counter() - t0) / n * 1e6:7.1f} us", flush=True)


def main() -> None:
    torch.set_num_threads(2)
    loaded = load_model(quantize="int8", dtype="float32")
    backend = backends.create(loaded.model, "native_cpu", int8=loaded.int8)
    target = Target(backend)
    target.argmax_only = True
    target.prefill(torch.randint(0, backend.w.head.n, (100,), generator=torch.Generator().manual_seed(0)))
    start, no_draft = target.cache_len, Draft.chain(torch.zeros(0, dtype=torch.long))
    timed("verify_rows", lambda: R.verify_rows([target], [5], [no_draft], [start]))
    rows = R.verify_rows([target], [5], [no_draft], [start])
    timed("embedding", lambda: backend.w.embedding(rows.ids).contiguous())
    h = backend.w.embedding(rows.ids).contiguous()
    timed("call_members", lambda: R.call_members(rows, backend.w.rope, backend._rope_keys, (), h))
    members, _, held = R.call_members(rows, backend.w.rope, backend._rope_keys, (), h)
    head = backend.w.head
    given = dict(h=h.data_ptr(), normed=h.data_ptr(), **members, **backend._dims, **backend._arrays,
                 norm_w=backend.w.norm.data_ptr(), window=None, kc=None, vc=None, cap=0, threads=2,
                 head_q=head.q.data_ptr(), head_s=head.scale.data_ptr(), head_z=head.wsum.data_ptr(), vocab=head.n,
                 head_from=0, logits=None)
    _, struct, abi = kernel.ENTRY_POINTS["w8a8"]

    def build():  # what kernel.call does before the call
        values = {k: ctypes.addressof(v) if isinstance(v, ctypes.Array) else v for k, v in given.items()}
        return struct(version=abi, size=ctypes.sizeof(struct), **values)

    timed("struct", build)
    logits = torch.randn(1, head.n)
    timed("logit_stats", lambda: kernel.logit_stats(logits, 2))
    del held


if __name__ == "__main__":
    main()
