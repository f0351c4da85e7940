"""What the int8 model's attention costs in a verify forward: in-process A/B of kernel builds that differ only there.

Builds four copies of the native kernel from the sources of this checkout (rows_int8.c patched in a temporary
folder; the package's own build is untouched):
- ``base``: the sources as they are;
- ``noatt``: ``attend_exact`` returns at once. The forward then computes garbage, so this build measures nothing
  but time: what a verify forward would cost if its attention cost nothing, the ceiling of any attention speed-up;
- ``prefetch``: software prefetch of the keys two blocks ahead (block_scores) and of the values 8 keys ahead
  (weigh), the values unchanged;
- ``float32``: the attention's double-precision vectors and sums turned into float32 ones of the same 8 lanes
  (256-bit), no widening. Its values differ from the reference's, so it too measures time only: what the
  arithmetic's width costs.
One process loads the int8 model, prefills a cache of ``context`` random tokens and alternates the four builds:
rounds of 30 timed verify forwards at K = 0 (a decode step) and K = 8 (a chain of 8 drafts), the order of the
builds rotated every round. Prints each build's fastest and median ms, and the median over the rounds of each round's
K = 8 / K = 0 (the two timed back to back, so a slow phase of the machine hits both).

With a shape (``1b``: ``mtpflow.tools.tune_shape``'s random Llama 3.2 1B, quantized to int8) the same runs over
that model instead of the default one.

    python docs/bench/attention_dec06/ab_attention.py [rounds] [context] [shape]
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtpflow import backends
from mtpflow.backends.native import kernel
from mtpflow.model import load_model
from mtpflow.target import Target
from mtpflow.types import Draft

ATTEND = "                         float scale, float softcap, const struct att_scratch *w) {\n"
KEYS_LOOP = "    for (int t = 0; t + KEYS <= n0; t += KEYS) {\n"
VALUES_LOOP = "        const float *vt = values + (size_t)t * d + c;\n"
PATCHES = {
    "noatt": [(ATTEND, ATTEND + "    return;\n")],
    "prefetch": [(KEYS_LOOP, KEYS_LOOP + "        if (t + 3 * KEYS <= n0) for (int e = 0; e < KEYS * d; e += 16)"
                  " __builtin_prefetch(keys + (size_t)(t + 2 * KEYS) * d + e, 0, 3);\n"),
                 (VALUES_LOOP, VALUES_LOOP + "        if (t + 8 < n) for (int i = 0; i < nv; i += 2)"
                  " __builtin_prefetch(vt + (size_t)8 * d + 8 * i, 0, 3);\n")],
}


def float32_attention(source: str) -> str:
    """rows_int8.c with its attention (from the double vector type to the end of the fused-multiply-add region) in
    float32: the same code, 8 float lanes where there were 8 double ones."""
    begin = source.index("typedef double dvec8")
    end = source.index("#pragma GCC pop_options")
    region = source[begin:end].replace("double dvec8 __attribute__((vector_size(64)))",
                                       "double dvec8 __attribute__((vector_size(32)))")
    return source[:begin] + region.replace("double", "float").replace("VW * 8", "VW * 4") + source[end:]


def build(folder: Path, name: str) -> Path:
    source = (kernel.HERE / "rows_int8.c").read_text()
    if name == "float32":
        source = float32_attention(source)
    for old, new in PATCHES.get(name, []):
        if source.count(old) != 1:
            sys.exit(f"rows_int8.c changed: the {name} patch does not apply")
        source = source.replace(old, new)
    out = folder / name / "kernel.so"
    if not kernel.build_replacing(out, "rows_int8.c", source):
        sys.exit(f"the {name} build failed")
    return out


def int8_backend(shape: str | None):
    """The native int8 backend over the default model, or over a random Llama of ``shape`` (tune_shape's)."""
    if shape is None:
        loaded = load_model(quantize="int8", dtype="float32")
        return backends.create(loaded.model, "native_cpu", int8=loaded.int8)
    from transformers import LlamaConfig, LlamaForCausalLM

    from mtpflow.tools.tune_shape import COMMON, SHAPES

    torch.manual_seed(0)
    with torch.no_grad():
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], **COMMON)).eval()
    return backends.create(model, "native_cpu", int8=backends.quantize_int8(model))


def main(rounds: int, context: int, shape: str | None) -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: kernel.load(build(Path(tmp), name)) for name in ("base", "noatt", "prefetch", "float32")}
        backend = int8_backend(shape)
        g = torch.Generator().manual_seed(0)
        target = Target(backend)
        target.argmax_only = True
        backend.lib = libs["base"]
        target.prefill(torch.randint(0, backend.w.head.n, (context,), generator=g))
        start = target.cache_len
        drafts = {k: Draft.chain(torch.randint(0, backend.w.head.n, (k,), generator=g)) for k in (0, 8)}
        times: dict[tuple[str, int], list[float]] = {}
        names = list(libs)
        for rnd in range(rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                backend.lib = libs[name]
                for k, draft in drafts.items():
                    for i in range(33):  # 3 untimed, 30 timed
                        if i == 3:
                            t0 = time.perf_counter()
                        target.cache_len = start
                        target.verify(1, draft, root_position=start)
                    times.setdefault((name, k), []).append(1000 * (time.perf_counter() - t0) / 30)
        print(f"{shape or 'default model'}, context {context}, {rounds} rounds; ms fastest / median")
        for name in names:
            k0, k8 = times[(name, 0)], times[(name, 8)]
            ratio = statistics.median(b / a for a, b in zip(k0, k8))  # each round's K=8 / K=0: a drift cancels
            print(f"{name:>8}  K=0 {min(k0):6.3f} / {statistics.median(k0):6.3f}   K=8 {min(k8):6.3f} / "
                  f"{statistics.median(k8):6.3f}   K=8 / K=0 fastest {min(k8) / min(k0):.2f}, per round (median) "
                  f"{ratio:.2f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16, int(sys.argv[2]) if len(sys.argv) > 2 else 256,
         sys.argv[3] if len(sys.argv) > 3 else None)
