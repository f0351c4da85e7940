"""The int8 KV cache against the float32 one: in-process A/B of two builds of the int8 model's decoder stack.

``before`` is rows_int8.c at a commit (default 4813f4e, the last whose cache held float32 keys and values), ``after``
the working tree's (int8 entries with a scale). Each build reads its own pool layout: a float32 pool for a build
before the int8 cache, else the backend's own. One process loads the int8 model, prefills a cache of ``context`` random
tokens into each pool and alternates the builds round by round (the order reversed every other round): 20 timed
verify forwards (after 3 untimed) per draft length ``k``. Prints each build's fastest and median ms, each K's
ratio to K = 0, and the median over the rounds of after / before (a drift of the machine hits both sides alike).
Builds on either side of the int8 cache compute different models (the cache's numerics differ): then this measures
time only.

    python docs/bench/int8_kv_dec06/ab_kv.py [rounds] [context] [k,k,...] [before-commit]
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtpflow import backends
from mtpflow.backends.native import kernel
from mtpflow.kv_cache import KVPool
from mtpflow.model import load_model
from mtpflow.target import Target
from mtpflow.types import Draft


def build(folder: Path, name: str, source: str):
    """The library with ``source`` as its rows_int8.c, loaded."""
    out = folder / name / "kernel.so"
    if not kernel.build_replacing(out, "rows_int8.c", source):
        sys.exit(f"the {name} build failed")
    return kernel.load(out)


def compare(sources: dict[str, str], context: int, ks: list[int], rounds: int, pools=None, backend=None,
            timed: int = 20) -> dict:
    """Builds of rows_int8.c from ``sources`` (name -> text) timed against each other in this process: the int8
    model's cache (``backend``'s model, default the default model) prefilled with ``context`` random tokens in each
    build's pool (``pools[name]``, default the backend's own), then ``rounds`` rounds alternating the builds (the
    order reversed every other round), ``timed`` verify forwards (after 3 untimed) per draft length. Prints each
    build's fastest and median ms and each K's ratio to the first K; returns the times {(name, k): [ms per round]}."""
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(Path(tmp), name, text) for name, text in sources.items()}
        if backend is None:
            loaded = load_model(quantize="int8", dtype="float32")
            backend = backends.create(loaded.model, "native_cpu", int8=loaded.int8)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, backend.w.head.n, (context,), generator=g)
        targets = {}
        for name in libs:
            pool = (pools or {}).get(name, lambda backend: backend.make_pool(1))(backend)
            targets[name] = Target(backend, pool=pool)
            targets[name].argmax_only = True
            backend.lib = libs[name]
            targets[name].prefill(prompt)
        start = targets[name].cache_len
        drafts = {k: Draft.chain(torch.randint(0, backend.w.head.n, (k,), generator=g)) for k in ks}
        times: dict[tuple[str, int], list[float]] = {}
        for rnd in range(rounds):
            for name in (list(libs) if rnd % 2 == 0 else list(libs)[::-1]):
                backend.lib, target = libs[name], targets[name]
                for k, draft in drafts.items():
                    for i in range(3 + timed):
                        if i == 3:
                            t0 = time.perf_counter()
                        target.cache_len = start
                        target.verify(1, draft, root_position=start)
                    times.setdefault((name, k), []).append(1000 * (time.perf_counter() - t0) / timed)
    print(f"context {context}, {rounds} rounds; ms fastest / median")
    for name in libs:
        k0 = times[(name, ks[0])]
        line = f"{name:>6}  K={ks[0]} {min(k0):6.3f} / {statistics.median(k0):6.3f}"
        for k in ks[1:]:
            kk = times[(name, k)]
            line += (f"   K={k} {min(kk):6.3f} / {statistics.median(kk):6.3f} ({min(kk) / min(k0):.2f}x K={ks[0]}, "
                     f"per round {statistics.median(b / a for a, b in zip(k0, kk)):.2f})")
        print(line, flush=True)
    return times


def float32_pool(context: int):
    """The float32 pool layout a build before the int8 cache reads, allocated as such (past the layout check)."""
    def make(backend):
        pool = KVPool(backend.model, 1)
        pool.ensure(context + 64)
        pool.entry_dtype, pool.entry_width = torch.int8, backend.w.head_dim + 4
        return pool
    return make


def main(rounds: int, context: int, ks: list[int], before: str) -> None:
    old = subprocess.run(["git", "show", f"{before}:mtpflow/backends/native/rows_int8.c"], capture_output=True,
                         text=True, check=True, cwd=kernel.HERE).stdout
    print(f"before = {before}")
    # a build before the int8 cache reads the float32 layout; one with it, the backend's own pool
    pools = None if "ENTRY_BYTES" in old else {"before": float32_pool(context)}
    times = compare({"before": old, "after": (kernel.HERE / "rows_int8.c").read_text()}, context, ks, rounds, pools)
    for k in ks:
        ratio = statistics.median(n / o for o, n in zip(times[("before", k)], times[("after", k)]))
        print(f"K={k}: after / before, median per round {ratio:.3f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 16, int(args[1]) if len(args) > 1 else 256,
         [int(x) for x in (args[2] if len(args) > 2 else "0,8").split(",")], args[3] if len(args) > 3 else "4813f4e")
