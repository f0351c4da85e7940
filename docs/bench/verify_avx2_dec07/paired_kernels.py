"""Old kernel against new in one process, question by question: each strategy runs twice over the int8 model, once on
this checkout's C sources and once on those at REV (built aside, the headers as they are here): one pipeline per
strategy, its backend pointed at either build before each request, with the cost curves of the tuning profile's entry
for that kernel (measured once where missing). Every variant decodes each question in turn, the order rotating;
Spec-Bench questions under 1500 characters (first turn), 128 new tokens, greedy, after one warm-up request per side; the
engine's shared state (suffix cache, prefix KV) is cleared before every request.
Prints tokens/s, MAL, and the ratio to the first variant; asserts that every variant gives the same tokens.

    [SKIP=n] python docs/bench/verify_avx2_dec07/paired_kernels.py REV PATH/question.jsonl N baseline pld mtp_heads
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mtpflow.api import pipeline
from mtpflow.backends.native import kernel
from mtpflow.shared import prepared

rev, path, count, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
skip = int(os.environ.get("SKIP", "0"))
sources = {}
for p in kernel.SOURCES:  # the old kernel's hash, as kernel.source_hash computes it over the old sources
    sources[p.name] = subprocess.run(["git", "show", f"{rev}:mtpflow/backends/native/{p.name}"], capture_output=True,
                                     text=True, check=True).stdout
folder = Path(tempfile.mkdtemp())
for name, text in sources.items():
    (folder / name).write_text(text)
assert kernel.build(kernel.compiler(), folder / "old.so", sources=tuple(folder / p.name for p in kernel.SOURCES)), \
    "the old build failed"
old_lib = kernel.load(folder / "old.so")
digest = hashlib.sha1()
for p in (*kernel.SOURCES, *kernel.HEADERS):  # the headers as they are here (unchanged since REV)
    digest.update(p.name.encode())
    digest.update(sources[p.name].encode() if p.name in sources else p.read_bytes())
old_hash = digest.hexdigest()

print(f"old kernel {old_hash[:10]}, new kernel {kernel.source_hash()[:10]}")
prompts = [q for q in (json.loads(line)["turns"][0] for line in open(path)) if len(q) < 1500]
libs = {"old": (old_lib, old_hash), "new": (kernel.library(), kernel.source_hash())}


def use(backend, side):
    """Point ``backend`` at one side's library, and its cost-curve key at that side's kernel."""
    lib, digest = libs[side]
    backend.lib = lib
    backend.kernel_identity = lambda: f"w8a8 {kernel.q8_isa(lib)} kernel:{digest[:10]}"


# one pipeline per strategy, its backend switched between the two builds: both sides read the same weights in the
# same memory (pipelines made one after another can land on other pages: huge or not)
pipes = {}
for name in names:
    strategy, *overrides = name.split("|")
    pipes[name] = pipeline(strategy, ["model.quantize=int8", "trace=off", "max_new_tokens=128"] + overrides)
    for side in libs:
        use(pipes[name].backend, side)
        pipes[name](prompts[0])
variants = [(name, side) for name in names for side in libs]
seconds, tokens, steps, outputs = ({v: 0.0 for v in variants}, {v: 0 for v in variants}, {v: 0 for v in variants},
                                   {})
for n, q in enumerate(prompts[1 + skip:1 + skip + count]):
    order = variants[n % len(variants):] + variants[:n % len(variants)]
    for name, side in order:
        use(pipes[name].backend, side)
        pipes[name].shared.clear(keep=prepared)  # a first-time request on both sides: no suffix cache, no prefix KV
        t = time.perf_counter()
        r = pipes[name](q)
        seconds[name, side] += time.perf_counter() - t
        tokens[name, side] += len(r.token_ids)
        steps[name, side] += r.stats["verify_forwards"]
        outputs.setdefault(n, r.token_ids)
        assert r.token_ids == outputs[n], f"{name} [{side}] differs on question {n}"  # lossless, both kernels
first = tokens[variants[0]] / seconds[variants[0]]
for v in variants:
    rate = tokens[v] / seconds[v]
    print(f"{v[0] + ' [' + v[1] + ']':50s} tok/s {rate:7.2f}  MAL {tokens[v] / steps[v]:.2f}  x first {rate / first:.3f}")
