"""The int8 model's whole verify forward (root + K chain tokens on a 256-token cache), old kernel against new in one
process: the C sources at REV built aside, the backend's library swapped between rounds, the sides alternating.

    python docs/bench/verify_avx2_dec07/ab_forward.py REV [rounds]

Per K: the median over the rounds of each side's fastest of 5 forwards, ms, its ratio to K=0 on the same side, and new / old.
"""
import subprocess, sys, tempfile
from pathlib import Path
from mtpflow.api import pipeline
from mtpflow.backends.native import kernel
from mtpflow.cost_model import time_verify_forwards

rev, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 9
folder = Path(tempfile.mkdtemp())
for p in kernel.SOURCES:
    (folder / p.name).write_text(subprocess.run(["git", "show", f"{rev}:mtpflow/backends/native/{p.name}"],
                                                capture_output=True, text=True, check=True).stdout)
assert kernel.build(kernel.compiler(), folder / "old.so", sources=tuple(folder / p.name for p in kernel.SOURCES))
libs = {"old": kernel.load(folder / "old.so"), "new": kernel.library()}
backend = pipeline("baseline", ["model.quantize=int8", "trace=off"]).backend
ks = [0, 1, 2, 3, 4, 6, 8, 16]
best = {(side, k): [] for side in libs for k in ks}
for r in range(rounds):
    for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
        backend.lib = libs[side]
        times = time_verify_forwards(backend, ks, 256, 5, argmax_only=True)
        for k in ks:
            best[side, k].append(min(times[k]))
med = {key: sorted(v)[len(v) // 2] * 1e3 for key, v in best.items()}
print(f"int8 default model, verify forward on a 256-token cache; old = C sources at {rev}, {kernel.q8_isa()}")
print(" K   old ms (x K=0)   new ms (x K=0)   new/old")
for k in ks:
    o, n = med["old", k], med["new", k]
    print(f"{k:2d}  {o:6.2f} ({o / med['old', 0]:4.2f}x)  {n:6.2f} ({n / med['new', 0]:4.2f}x)  {n / o:6.3f}")
