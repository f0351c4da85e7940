"""Every native entry point (mtpflow/backends/native/*.c) against its pure-torch reference (backends.native.reference) over
many shapes, for every build this CPU can run (kernel.runnable_isas, plus the -march=native build the
package uses), in the manner of llama.cpp's test-backend-ops; the versioned struct of mtpflow_llama_rows (a build
of another ABI is refused, a struct of another version or size is answered with an error code); and a subset of
the same checks under AddressSanitizer + UBSan, in a subprocess.

The products are checked against a float64 reference within a proven bound: however a kernel orders the float32
sum of k products (vector lanes, blocks, fused multiply-adds), each output is within gamma(k + 2) times
sum_i |x_i w_i| (+ |b|) of the exact value (Higham's bound for a sum of k rounded products, two more roundings
for the int8 scale and the bias; gamma(n) = n u / (1 - n u), u = 2^-24). A wrong index, a lost tail or a
misread bias moves an output by about one term, |x_i w_i| ~ 1, far outside it for these sizes."""
from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import random
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from families import FAMILIES as FAMILY_NAMES
from mtpflow.backends.hf import tree_allowed
from mtpflow.errors import UserError
from mtpflow.backends.native import kernel, products, reference as native_reference
from mtpflow.backends.native.reference import LlamaLayerWeights
from mtpflow.backends.native.rows import VerifyRows, optional

CC = kernel.compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler to build the native kernels")
BUILDS = (*kernel.runnable_isas(), "native")  # "native": kernel.FLAGS, what library() builds

ROWS = (1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 16, 17, 25, 33)
# (outputs n, inputs k): n below, at and past the 4-row blocks and the 32-wide panels; k below, at and past the
# 8- and 16-float vectors, odd
SHAPES = ((1, 1), (3, 5), (4, 8), (5, 17), (16, 16), (64, 64), (65, 33), (130, 100), (200, 257))


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{build name: loaded library} for BUILDS, each compiled once (two at a time) into a temporary folder."""
    if CC is None:
        return {}
    folder = tmp_path_factory.mktemp("native-builds")

    def compile_one(name: str):
        out = folder / f"{name}.so"
        done = (kernel.build(CC, out) if name == "native" else kernel.build_variant(name, out, CC))
        return name, (kernel.load(out) if done else None)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(compile_one, BUILDS))


def _lib(builds, name):
    lib = builds.get(name)
    if lib is None:
        pytest.skip(f"the {name} build does not compile here")
    return lib


# ----- the products ------------------------------------------------------------------------------------------

def product_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, roundings: int) -> torch.Tensor:
    """gamma(roundings) * (|x| @ |w|^T + |b|) in float64: the largest error of any float32 evaluation order."""
    u = 2.0 ** -24
    gamma = roundings * u / (1 - roundings * u)
    magnitude = x.double().abs() @ w.double().abs().T
    return gamma * (magnitude + (b.double().abs() if b is not None else 0.0)) + 1e-30


def _within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, case: str) -> None:
    excess = (got.double() - ref).abs() - bound
    assert got.dtype == torch.float32 and got.shape == ref.shape, case
    assert bool((excess <= 0).all()), f"{case}: off by {float(excess.max()):.3g} past the bound"


def check_products(lib, rows=ROWS, shapes=SHAPES, threads=(1, 2), threaded_rows=(2, 7, 17, 33), seed=0) -> int:
    """The float products (rows, panels) and the int8-weight products (rows, panels) against their references, on
    every thread count for ``threaded_rows`` and on the first for the other row counts (the threads split the weight
    rows or panels, whatever the row count; on a busy 2-core host every 2-thread region can wait for a core);
    returns the number of calls checked."""
    generator = torch.Generator().manual_seed(seed)
    calls = 0
    for n, k in shapes:
        w = torch.randn(n, k, generator=generator)
        panels = products.pack_panels(w)
        assert torch.equal(native_reference.unpack_panels(panels, n), w)  # the panels hold the weight
        q, scale = products.quantize_int8(w)
        qpanels = products.pack_q8_panels(q)
        deq = q.double() * scale.double()[:, None]
        for m in rows:
            x = torch.randn(m, k, generator=generator)
            for b in (None, torch.randn(n, generator=generator)):
                b_ptr = None if b is None else b.data_ptr()
                exact = native_reference.small_gemm_reference(x.double(), w.double(), None if b is None else b.double())
                bound = product_bound(x, w, b, k + 1)
                exact_q = native_reference.small_gemm_q8_reference(x.double(), q, scale.double(),
                                                                   None if b is None else b.double())
                bound_q = product_bound(x, deq, b, k + 3)
                panel_exact = native_reference.panel_gemm_reference(x.double(), panels.double(), n,
                                                                    None if b is None else b.double())
                for t in (threads if m in threaded_rows else threads[:1]):
                    case = f"m={m} n={n} k={k} bias={b is not None} threads={t}"
                    for kind, weight, ref, limit in ((products.F32, dict(w=w.data_ptr()), exact, bound),
                                                     (products.PANELS, dict(panels=panels.data_ptr()), panel_exact,
                                                      bound),
                                                     (products.Q8, dict(q=q.data_ptr(), scale=scale.data_ptr()),
                                                      exact_q, bound_q),
                                                     (products.Q8_PANELS,
                                                      dict(q=qpanels.data_ptr(), scale=scale.data_ptr()),
                                                      exact_q, bound_q)):
                        y = torch.empty(m, n)
                        assert kernel.call(lib, "linear", kind=kind, M=m, N=n, K=k, threads=t, x=x.data_ptr(),
                                           b=b_ptr, y=y.data_ptr(), **weight) == 0
                        _within(y, ref, limit, f"mtpflow_linear kind {kind} {case}")
                    calls += 4
    return calls


@needs_cc
@pytest.mark.parametrize("build", BUILDS)
def test_products_match_their_references(builds, build):
    lib = _lib(builds, build)
    expected = {"avx512": 16, "avx2": 8, "generic": 8}.get(build)  # "native": whatever this CPU has
    if expected is not None:  # the build really took its vector width (__AVX512F__ or not)
        assert lib.mtpflow_vector_width() == expected
    assert check_products(lib) == len(SHAPES) * (len(ROWS) + 4) * 2 * 4


# ----- mtpflow_llama_rows ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowsCase:
    """A decoder stack (L layers, hidden H, nh query heads over nkv key/value heads of size d, intermediate I) and
    the sequences verified in one call: (cached prefix, "chain" or "tree", new rows) each; and the parts of a layer
    description it has (``mtpflow.backends.native.description``): ``parts`` of "bias" (on every product),
    "qk_norm", "post_norm" (norms of the attention's and the MLP's outputs), "softcap" (of the scores), "gelu"
    (GELU-tanh, else SiLU), "no_rope" (every third layer without rotary), "local_global" (two rotary tables);
    ``window``: a sliding window on every second layer (0: none); ``rot``: rotary values per head (0: all)."""
    L: int
    H: int
    nh: int
    nkv: int
    d: int
    I: int
    sequences: tuple[tuple[int, str, int], ...]
    parts: frozenset = frozenset()
    window: int = 0
    rot: int = 0


ROWS_CASES = (
    RowsCase(1, 32, 2, 2, 16, 40, ((0, "chain", 1),)),  # one plain step over an empty cache
    RowsCase(2, 48, 6, 2, 8, 37, ((5, "chain", 4), (37, "tree", 6))),  # GQA, head_dim 8, I past the vectors
    RowsCase(3, 64, 4, 1, 16, 64, ((3, "chain", 1), (20, "tree", 9), (0, "chain", 3))),  # one kv head, 3 sequences
    RowsCase(2, 128, 2, 1, 64, 96, ((150, "chain", 9), (7, "tree", 8))),  # head_dim 64; attention on threads
    # head_dim 128, three query heads a key head: the attention's units share each key block among several queries
    # (one sequence: a prefix past whole blocks, its own entries in the last one); then one row alone
    RowsCase(2, 64, 6, 2, 128, 64, ((70, "chain", 7), (33, "tree", 5), (45, "chain", 1))),
    # head_dim 144: 9 vectors of 16 floats, 18 of 8 (an instance past the common sizes)
    RowsCase(1, 32, 2, 1, 144, 32, ((20, "chain", 3), (9, "tree", 4))),
    # one row, four query heads on one key head: a unit holds two of them on one thread and one on two threads, so
    # check_rows' equal outputs on both thread counts hold only if a query's arithmetic ignores its unit
    RowsCase(2, 64, 4, 1, 64, 64, ((90, "chain", 1),)),
    # Qwen2-like: biases, a window shorter than the prefixes (every second layer)
    RowsCase(2, 48, 4, 2, 16, 40, ((30, "chain", 4), (9, "tree", 7)), frozenset({"bias"}), window=6),
    # Gemma 2-like: norms around each block, soft-capped scores, GELU-tanh, a window reaching into a tree
    RowsCase(2, 32, 2, 1, 16, 48, ((3, "tree", 9), (20, "chain", 2)), frozenset({"post_norm", "softcap", "gelu"}),
             window=4),
    # Gemma 3-like: head size 256, q / k norms, local and global tables; Phi-3-like partial rotary; no-rope layers
    RowsCase(3, 64, 2, 1, 256, 64, ((12, "chain", 3), (0, "tree", 5)),
             frozenset({"qk_norm", "post_norm", "gelu", "local_global", "no_rope"}), window=8, rot=128),
)

def _parents(kind: str, n: int, rng: random.Random) -> list[int]:
    """Node 0 the root (the committed token), then a chain or a random tree under it."""
    return [-1] + [i - 1 if kind == "chain" else rng.randint(0, i - 1) for i in range(1, n)]


def _pointers(tensors):
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


class RowsInputs:
    """One call's inputs, float32 as the kernel reads them, built from a seed; ``run`` calls a build, ``reference``
    the float64 reference (over the dequantized weights where ``int8``)."""

    def __init__(self, case: RowsCase, seed: int):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        L, H, nh, nkv, d, I = case.L, case.H, case.nh, case.nkv, case.d, case.I
        self.case, self.eps, self.scale = case, 1e-5, d ** -0.5

        def randn(*shape, std=1.0):
            return torch.randn(*shape, generator=g) * std

        # weights scaled so every activation stays of order one through the layers
        self.layers = [LlamaLayerWeights(ln1=1 + randn(H, std=0.1), wqkv=randn((nh + 2 * nkv) * d, H, std=H ** -0.5),
                                         wo=randn(H, nh * d, std=(nh * d) ** -0.5), ln2=1 + randn(H, std=0.1),
                                         wgu=randn(2 * I, H, std=H ** -0.5), wd=randn(H, I, std=I ** -0.5))
                       for _ in range(L)]
        parts = case.parts
        for index, layer in enumerate(self.layers):
            if "bias" in parts:
                layer.bqkv, layer.bo = randn((nh + 2 * nkv) * d, std=0.3), randn(H, std=0.3)
                layer.bgu, layer.bd = randn(2 * I, std=0.3), randn(H, std=0.3)
            if "qk_norm" in parts:
                layer.qn, layer.kn = 1 + randn(d, std=0.1), 1 + randn(d, std=0.1)
            if "post_norm" in parts:
                layer.post_attn, layer.post_mlp = 1 + randn(H, std=0.1), 1 + randn(H, std=0.1)
            layer.window = case.window if index % 2 == 0 else 0
        self.act = 1 if "gelu" in parts else 0
        self.softcap = 2.0 if "softcap" in parts else 0.0
        self.norm = 1 + randn(H, std=0.1)
        # the sequences in shuffled slots, one slot more that no row touches
        slots = list(range(len(case.sequences) + 1))
        rng.shuffle(slots)
        self.capacity = max(p + n for p, _, n in case.sequences) + 3
        slot, wpos, prefix, first, count, positions, masks = [], [], [], [], [], [], []
        for (p, kind, n), s in zip(case.sequences, slots):
            parents = _parents(kind, n, rng)
            allowed = tree_allowed(torch.tensor(parents[1:], dtype=torch.long) - 1)  # row 0: the root
            depth = [0] * n
            for i in range(1, n):
                depth[i] = depth[parents[i]] + 1
            start = len(slot)
            for j in range(n):  # row first + j writes its entry at prefix + j (where the kernel looks for it)
                slot.append(s), wpos.append(p + j), prefix.append(p), first.append(start), count.append(n)
                positions.append(p + depth[j])
                masks.append(allowed[j])
        self.slot, self.wpos, self.prefix, self.first, self.count = slot, wpos, prefix, first, count
        self.positions = positions
        m, qmax = len(slot), max(count)
        self.allowed = torch.zeros(m, qmax, dtype=torch.uint8)
        for r, mask in enumerate(masks):
            self.allowed[r, : len(mask)] = mask.to(torch.uint8)
        # each slot's cached prefix random, everything past it NaN: a read of an entry the call neither had nor
        # wrote poisons the outputs
        cached = dict((s, p) for (p, _, _), s in zip(case.sequences, slots))
        cached[slots[-1]] = self.capacity // 2
        self.keys, self.values = [], []
        for _ in range(L):
            for pool in (self.keys, self.values):
                buffer = torch.full((len(slots), nkv, self.capacity, d), float("nan"))
                for s, p in cached.items():
                    buffer[s, :, :p] = randn(nkv, p, d)
                pool.append(buffer)
        self.written = torch.zeros(len(slots), self.capacity, dtype=torch.bool)
        self.written[torch.tensor(slot), torch.tensor(wpos)] = True
        self.rot = case.rot or d
        tables = []
        for theta in ((10000.0, 1e6) if "local_global" in parts else (10000.0,)):
            inv_freq = theta ** (-torch.arange(0, self.rot, 2, dtype=torch.float64) / self.rot)
            angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None]
            emb = torch.cat((angles, angles), dim=-1)  # Llama's layout: the same frequencies in both halves
            tables.append((emb.cos().float().contiguous(), emb.sin().float().contiguous()))
        for index, layer in enumerate(self.layers):
            if "no_rope" in parts and index % 3 == 2:
                continue
            layer.cos, layer.sin = tables[index % len(tables)]
        self.h = randn(m, H)
        self.int8 = [[products.quantize_int8(getattr(layer, name)) for layer in self.layers]
                     for name in ("wqkv", "wo", "wgu", "wd")]
        self.taps = (0,) if L > 1 else ()

    def run(self, lib, threads: int, panels: bool = False, int8: bool = False):
        """(h out, normed, keys, values, {layer: its output} for ``taps``, the call's return code) from one call of
        ``lib``'s mtpflow_llama_rows."""
        c = self.case
        h, normed = self.h.clone(), torch.empty_like(self.h)
        keys, values = [k.clone() for k in self.keys], [v.clone() for v in self.values]
        weights = [_pointers([getattr(layer, name) for layer in self.layers])
                   for name in ("ln1", "wqkv", "wo", "ln2", "wgu", "wd")]
        held = []  # what the pointer arrays point into, alive until the call returns
        copies = {}
        if panels and not int8:
            held = [[products.pack_panels(getattr(layer, name)) for layer in self.layers]
                    for name in ("wqkv", "wo", "wgu", "wd")]
            copies = {name: _pointers(ps) for name, ps in zip(("pqkv", "po", "pgu", "pd"), held)}
        if int8:
            for name, pairs in zip(("qkv", "o", "gu", "d"), self.int8):
                copies["q" + name] = _pointers([q for q, _ in pairs])
                copies["s" + name] = _pointers([s for _, s in pairs])
        ints = [torch.tensor(v, dtype=torch.int32) for v in (self.slot, self.wpos, self.prefix, self.first,
                                                             self.count, self.positions)]
        layer_parts = {name: optional([getattr(layer, name) for layer in self.layers])
                    for name in ("post_attn", "post_mlp", "qn", "kn", "bqkv", "bo", "bgu", "bd", "cos", "sin")}
        windows = torch.tensor([layer.window for layer in self.layers], dtype=torch.int32)
        tapped = {t: torch.empty_like(self.h) for t in self.taps}
        taps = optional([tapped.get(i) for i in range(c.L)])
        code = kernel.llama_rows(
            lib, h=h.data_ptr(), normed=normed.data_ptr(), taps=taps, M=len(self.slot), L=c.L, H=c.H, nh=c.nh,
            nkv=c.nkv, d=c.d, I=c.I, **dict(zip(("ln1", "wqkv", "wo", "ln2", "wgu", "wd"), weights)), **copies,
            **layer_parts, window=windows.data_ptr(), rot=self.rot, act=self.act, softcap=self.softcap,
            norm_w=self.norm.data_ptr(), eps=self.eps, kc=_pointers(keys), vc=_pointers(values), cap=self.capacity,
            **{name: t.data_ptr() for name, t in zip(("slot", "wpos", "prefix", "first", "count", "pos"), ints)},
            allowed=self.allowed.data_ptr(), qmax=self.allowed.shape[1], scale=self.scale, threads=threads)
        return h, normed, keys, values, tapped, code

    def reference(self, int8: bool = False):
        layers = self.layers
        if int8:
            dequantized = [[q.double() * s.double()[:, None] for q, s in copies] for copies in self.int8]
            layers = [dataclasses.replace(layer, wqkv=qkv, wo=o, wgu=gu, wd=down)
                      for layer, qkv, o, gu, down in zip(self.layers, *dequantized)]
        c = self.case
        return native_reference.llama_rows_reference(
            self.h.double(), layers, self.norm, self.eps, self.keys, self.values, self.slot, self.wpos, self.prefix,
            self.first, self.count, self.positions, self.allowed, self.scale, c.nh, c.nkv, c.d, self.act,
            self.softcap, self.taps)


# float32 kernel against the float64 reference: each product's float32 sum of at most a few hundred terms is off by
# about sqrt(k) u relative (u = 6e-8), the exponentials (vexp, expf) and rsqrt by a few ulp, and the RMSNorms put
# every layer's input back at unit scale, so after three layers the outputs (of order one) are within ~1e-5; a
# wrong mask, rotary convention, head mapping or KV position moves them by 1e-2 or more
ROWS_TOLERANCE = dict(rtol=2e-5, atol=2e-5)


def check_rows(lib, case: RowsCase, seed: int, threads=(1, 2), modes=("rows", "panels", "int8")) -> None:
    """mtpflow_llama_rows of ``lib`` against the reference for ``case``: the outputs, the entries written into the
    pool, the entries not written left bit for bit as they were; and the same numbers on every thread count."""
    inputs = RowsInputs(case, seed)
    references = {}
    for mode in modes:
        int8 = mode == "int8"
        if int8 not in references:
            references[int8] = inputs.reference(int8)
        h_ref, normed_ref, keys_ref, values_ref, taps_ref = references[int8]
        outputs = []
        for t in threads:
            label = f"{case} seed={seed} {mode} threads={t}"
            h, normed, keys, values, taps, code = inputs.run(lib, t, panels=mode == "panels", int8=int8)
            assert code == 0, label
            torch.testing.assert_close(h.double(), h_ref, **ROWS_TOLERANCE, msg=lambda m: f"h {label}: {m}")
            torch.testing.assert_close(normed.double(), normed_ref, **ROWS_TOLERANCE,
                                       msg=lambda m: f"normed {label}: {m}")
            for layer, tap in taps.items():
                torch.testing.assert_close(tap.double(), taps_ref[layer], **ROWS_TOLERANCE,
                                           msg=lambda m: f"tap {layer} {label}: {m}")
            for name, got, ref, before in (("keys", keys, keys_ref, inputs.keys),
                                           ("values", values, values_ref, inputs.values)):
                for layer, (g, r, b) in enumerate(zip(got, ref, before)):
                    written = inputs.written[:, None, :, None].expand_as(g)
                    torch.testing.assert_close(g[written].double(), r[written], **ROWS_TOLERANCE,
                                               msg=lambda m: f"{name}[{layer}] {label}: {m}")
                    assert torch.equal(g[~written].nan_to_num(7.0), b[~written].nan_to_num(7.0)), \
                        f"{name}[{layer}] {label}: an entry no row writes changed"
            outputs.append((h, normed, keys, values))
        for other in outputs[1:]:  # each row's arithmetic does not depend on how the rows split over the threads
            assert all(torch.equal(a, b) for a, b in zip(outputs[0][:2], other[:2])), f"{case} {mode}"


@needs_cc
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("case", range(len(ROWS_CASES)))
def test_llama_rows_match_the_reference(builds, build, case):
    check_rows(_lib(builds, build), ROWS_CASES[case], seed=case)


# ----- the int8 model (mtpflow_gemm_w8a8, mtpflow_w8a8_rows): bit for bit its torch reference -------------------

def check_w8a8(lib, rows=(1, 2, 5, 6, 7, 12, 13, 25), shapes=((1, 1), (5, 7), (65, 64), (130, 100), (33, 257)), seed=0) -> int:
    """The int8 product and a tiny int8 Llama's forward (``check_int8_forward``) through ``lib``, each equal to
    ``int8_reference`` bit for bit; returns the number of product calls checked (the forward's checks are its
    own asserts)."""
    from helpers import make_tiny_model
    from mtpflow.backends.native import int8_reference as R

    generator = torch.Generator().manual_seed(seed)
    calls = 0
    for n, k in shapes:
        lin = R.Int8Linear.of(torch.randn(n, k, generator=generator))
        for m in rows:
            x = torch.randn(m, k, generator=generator) * 3
            assert torch.equal(products.gemm_w8a8(x, lin.q, lin.scale, lin.wsum, k, lib), R.linear(x, lin)), \
                f"gemm_w8a8 m={m} n={n} k={k}"
            calls += 1
    check_int8_forward(lib, make_tiny_model(96, seed=seed, layers=2), seed)
    return calls


def check_int8_forward(lib, model, seed=0, lengths=(9, 3)) -> None:
    """``model`` as the int8 model through ``lib``: prompts of ``lengths`` prefilled into two slots with taps (the
    first layer's output, the final norm), then one verify of both: a tree of two children under the first's root,
    a single row for the second; every logit and tap equal to ``int8_reference``'s, which runs each sequence (and
    each tree path) alone. Returns the number of calls checked."""
    import copy

    from mtpflow.backends import create, quantize_int8
    from mtpflow.backends.native import int8_reference as R
    from helpers import prompt_rows

    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    weights = quantize_int8(model)
    backend = create(model, int8=weights)
    backend.lib = lib
    pool = backend.make_pool(2)
    prompts = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    refs = [R.Int8Reference(weights) for _ in prompts]
    for slot, (ids, ref) in enumerate(zip(prompts, refs)):
        logits, hidden = backend.run(pool, prompt_rows(ids, slot), (0, -1))
        ref_logits, ref_normed, ref_taps = ref.forward(ids, taps=(0,))
        assert torch.equal(logits, ref_logits[-logits.shape[0]:]), f"prefill logits, slot {slot}"
        assert torch.equal(hidden, torch.cat([ref_taps[0], ref_normed], -1)), f"prefill taps, slot {slot}"
    tree, single = torch.randint(1, vocab, (3,), generator=generator), torch.randint(1, vocab, (1,), generator=generator)
    n0, n1 = lengths
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 0, 0]], dtype=torch.uint8)  # root, two children
    rows = VerifyRows(torch.cat([tree, single]), torch.tensor([n0, n0 + 1, n0 + 1, n1]), allowed, [0, 0, 0, 1],
                      [n0, n0 + 1, n0 + 2, n1], [n0, n0, n0, n1], [0, 0, 0, 3], [3, 3, 3, 1], [0, 3], [3, 1])
    logits, _ = backend.run(pool, rows)
    other = copy.deepcopy(refs[0])  # the second child's path: the root, then it
    assert torch.equal(logits[:2], refs[0].forward(tree[:2])[0]), "the root and the first child"
    assert torch.equal(logits[2], other.forward(tree[[0, 2]])[0][1]), "the second child"
    assert torch.equal(logits[3:], refs[1].forward(single)[0]), "the second sequence's row"


@needs_cc
@pytest.mark.parametrize("build", BUILDS)
def test_the_int8_model_matches_its_reference_bit_for_bit(builds, build):
    lib = _lib(builds, build)
    expected = {"generic": "plain C", "avx2": "AVX2", "avx512": "AVX2"}.get(build)  # skylake-avx512: no VNNI
    if expected is not None:
        assert kernel.q8_isa(lib) == expected
    assert check_w8a8(lib) == 5 * 8


AMX_FLAGS = ("amx_tile", "amx_int8")


def test_the_amx_path_compiles_where_the_compiler_knows_it(tmp_path):
    """The AMX tile path (w8a8.c) is compiled into a build for a CPU with AMX (Sapphire Rapids) by a compiler that
    knows the instructions: its tile products are in the library. Compiling is all this can check on a CPU without
    AMX; test_amx_products_are_the_vnni_products runs them where there is one."""
    if CC is None:
        pytest.skip("no C compiler")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("AMX is an x86-64 extension")
    out = tmp_path / "amx.so"
    if not kernel.build(CC, out, ("-O2", "-march=sapphirerapids", "-fopenmp", "-shared", "-fPIC")):
        pytest.skip(f"{CC} does not know -march=sapphirerapids")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to look for the tile instructions")
    code = subprocess.run([objdump, "-d", str(out)], capture_output=True, text=True, timeout=120).stdout
    assert "tdpbusd" in code and "tileloadd" in code and "ldtilecfg" in code


@needs_cc
def test_amx_products_are_the_vnni_products(builds):
    """Where the CPU has AMX: the int8 products and a tiny int8 model's forward on the tiles equal the reference bit
    for bit, as the VNNI path's do (both add the same exact integers)."""
    missing = [flag for flag in AMX_FLAGS if flag not in kernel.cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} (/proc/cpuinfo): the AMX path is compiled here, not run")
    lib = _lib(builds, "native")
    assert lib.mtpflow_q8_amx_built() == 1, "the native build on an AMX CPU has no AMX path (compiler too old?)"
    try:
        assert lib.mtpflow_q8_amx(1) == 1, "Linux did not grant the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
        assert kernel.q8_isa(lib) == "AMX"
        assert check_w8a8(lib, rows=(2, 5, 16, 17, 33)) == 5 * 5
        assert lib.mtpflow_q8_amx(0) == 0 and kernel.q8_isa(lib) == "AVX-512 VNNI"
        assert check_w8a8(lib, rows=(2, 17)) == 5 * 2
    finally:
        lib.mtpflow_q8_amx(1)


# ----- every model family (tests/families.py) ----------------------------------------------------------------

def check_family_float(lib, family: str, seed: int = 0) -> None:
    """A tiny random ``family`` model through ``lib``'s mtpflow_llama_rows against the ``hf`` backend (the model's
    own forward, or the lean one for a Llama): two prompts longer than its sliding window prefilled with taps (the
    first layer's output, the final norm), then ONE verify of a tree for the first and a chain for the second, then
    one row of the first alone: logits and taps within the float32 tolerance of another summation order."""
    from families import make_family_model
    from mtpflow.backends.hf import HFBackend
    from mtpflow.backends.native.cpu import NativeCPUBackend
    from mtpflow.kv_cache import KVPool
    from mtpflow.target import Target
    from mtpflow.types import Draft

    model = make_family_model(family, 96, seed)
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 96, (n,), generator=generator) for n in (20, 15)]
    tree = Draft(torch.tensor([7, 8, 9, 10, 11]), torch.tensor([-1, -1, 0, 0, 2]))

    def run(backend):
        pool = KVPool(model, max_slots=2)
        out = []
        with torch.inference_mode():
            targets = [Target(backend, pool=pool, need_hidden=(0, -1)) for _ in prompts]
            out += [t.prefill(p) for t, p in zip(targets, prompts)]
            out += [(v.logits, v.hidden) for v in backend.verify(targets, [5, 6], [tree, Draft.chain([3, 4, 5])],
                                                                  [t.cache_len for t in targets])]
            one = targets[0].verify(12, Draft.chain([]), targets[0].cache_len)
            out.append((one.logits, one.hidden))
        return out

    native = NativeCPUBackend(model)
    native.lib = lib
    for (a_logits, a_hidden), (b_logits, b_hidden) in zip(run(native), run(HFBackend(model))):
        torch.testing.assert_close(a_logits, b_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a_hidden, b_hidden, rtol=1e-4, atol=1e-4)


@needs_cc
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_family_float32_matches_the_hf_backend(builds, build, family):
    check_family_float(_lib(builds, build), family)


@needs_cc
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_family_int8_matches_its_reference_bit_for_bit(builds, build, family):
    from families import make_family_model

    check_int8_forward(_lib(builds, build), make_family_model(family, 96), lengths=(20, 15))


# ----- the versioned struct ----------------------------------------------------------------------------------

def test_the_python_mirror_has_the_c_struct_layout(tmp_path):
    """Every member of each entry point's struct mirror at the offset C gives it (a struct of the same size with two
    members swapped would pass the size check)."""
    if CC is None:
        pytest.skip("no C compiler")
    for source, struct, mirror in (("gemm.c", "mtpflow_linear_args", kernel.LinearArgs),
                                   ("rows_float.c", "mtpflow_rows_args", kernel.RowsArgs),
                                   ("rows_int8.c", "mtpflow_w8a8_args", kernel.W8A8Args),
                                   ("logit_stats.c", "mtpflow_logit_stats_args", kernel.LogitStatsArgs)):
        names = [name for name, _ in mirror._fields_]
        helper = tmp_path / f"{struct}.c"
        helper.write_text(f'#include <stddef.h>\n#include "{kernel.HERE / source}"\n'
                          "long offsets[] = {" + ", ".join(f"offsetof(struct {struct}, {n})" for n in names) + "};\n")
        out = tmp_path / f"{struct}.so"
        others = tuple(p for p in kernel.SOURCES if p.name != source)  # the rest of the library, for the link
        assert kernel.build(CC, out, ("-O0", "-fopenmp", "-shared", "-fPIC"), (helper, *others))
        offsets = list((ctypes.c_long * len(names)).in_dll(ctypes.CDLL(str(out)), "offsets"))
        assert offsets == [getattr(mirror, n).offset for n in names], struct


@needs_cc
@pytest.mark.parametrize("version_delta,size_delta", [(1, 0), (-1, 0), (0, -8), (0, 8)])
def test_a_struct_of_another_version_or_size_is_answered_with_an_error_code(builds, version_delta, size_delta):
    """Every pointer NULL and M large: a function that read past version and size would crash."""
    lib = _lib(builds, "native")
    for entry, fill in (("rows", dict(M=1000, L=30, H=576)), ("w8a8", dict(M=1000, L=30, H=576)),
                        ("linear", dict(M=1000, N=1000, K=1000)), ("logit_stats", dict(rows=1000, vocab=1000))):
        function, struct, abi = kernel.ENTRY_POINTS[entry]
        args = struct(abi + version_delta, ctypes.sizeof(struct) + size_delta, **fill)
        assert getattr(lib, function)(ctypes.byref(args)) == kernel.BAD_ABI == -2, entry


def _build_edited(tmp_path, name: str, old: str, new: str, source: str = "rows_float.c") -> Path:
    """The library with one edit in ``source``."""
    text = (kernel.HERE / source).read_text()
    assert text.count(old) == 1, old
    out = tmp_path / f"{name}.so"
    assert kernel.build_replacing(out, source, text.replace(old, new), CC, ("-O0", "-fopenmp", "-shared", "-fPIC"))
    return out


@needs_cc
def test_a_build_of_another_abi_is_refused_with_one_line(tmp_path, monkeypatch):
    size = ctypes.sizeof(kernel.RowsArgs)
    abi = kernel.ENTRY_POINTS["rows"][2]
    foreign = _build_edited(tmp_path, "v999", f"#define MTPFLOW_ROWS_ABI {abi}\n", "#define MTPFLOW_ROWS_ABI 999\n")
    grown = _build_edited(tmp_path, "grown", "    MTPFLOW_DESCRIPTION_MEMBERS\n    /* int8 copies",
                          "    MTPFLOW_DESCRIPTION_MEMBERS\n    double extra;\n    /* int8 copies")
    bare = tmp_path / "bare.c"
    bare.write_text("int mtpflow_vector_width(void) { return 8; }\n")
    assert kernel.build(CC, tmp_path / "bare.so", ("-O0", "-shared", "-fPIC"), (bare,))
    for path, says in ((foreign, f"has mtpflow_llama_rows ABI v999 ({size} bytes), this mtpflow expects v{abi} ({size} bytes)"),
                       (grown, f"has mtpflow_llama_rows ABI v{abi} ({size + 8} bytes), this mtpflow expects v{abi} "
                               f"({size} bytes)"),
                       (tmp_path / "bare.so", "lacks mtpflow_linear or its ABI version")):
        with pytest.raises(UserError) as refused:
            kernel.load(path)
        message = str(refused.value)
        assert "\n" not in message and says in message and message.endswith("delete it to rebuild"), message
        assert message.startswith(f"native kernel {path} ")
    # the cached build of this source's path holding a foreign library: library() says so rather than carrying
    # on without the kernels
    monkeypatch.setenv("MTPFLOW_CACHE", str(tmp_path / "cache"))
    kernel.library.cache_clear()
    try:
        cached = kernel.build_path(CC)
        cached.parent.mkdir(parents=True)
        cached.write_bytes(foreign.read_bytes())
        with pytest.raises(UserError, match="has mtpflow_llama_rows ABI v999"):
            kernel.library()
    finally:
        kernel.library.cache_clear()


# ----- under AddressSanitizer + UBSan ------------------------------------------------------------------------

SANITIZE = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fopenmp", "-shared", "-fPIC")


def sanitizer_subset(paths: list[str]) -> None:
    """What the sanitized subprocess runs: a few shapes of every entry point on each build in ``paths``."""
    from helpers import make_tiny_model

    torch.set_num_threads(2)
    for path in paths:
        lib = kernel.load(Path(path))
        check_products(lib, rows=(1, 2, 3, 7, 17), shapes=((1, 1), (5, 17), (65, 33), (130, 100)))
        for seed, case in enumerate(ROWS_CASES[1:3]):
            check_rows(lib, case, seed)
        check_w8a8(lib, rows=(1, 2, 7), shapes=((1, 1), (5, 7), (130, 100)))
        # head size 80: the attention's vector paths over 64 values and the rest, over an odd number of keys
        check_int8_forward(lib, make_tiny_model(96, seed=1, layers=1, hidden=320), 1, lengths=(37, 3))
        check_logit_stats(lib)
        print(f"checked {path} (vector width {lib.mtpflow_vector_width()})", flush=True)


def logit_cases():
    """(name, logits [rows, vocab]) for mtpflow_logit_stats: vocabularies below, at and past a vector, the default
    model's; distinct values, ties, a flat row, -inf rows, a NaN, +inf, rows farther apart than a vocabulary"""
    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 1), (2, 7), (3, 16), (4, 33), (9, 1000), (13, 4099), (1, 49152)):
        x = (torch.randn(rows, 2 * vocab, generator=g) * 4)[:, :vocab]  # rows 2 vocab floats apart
        yield f"{rows}x{vocab}", x
        yield f"{rows}x{vocab} ties", x.round()  # many equal maxima: the first index wins
        flat = x.clone()
        flat[-1] = 3.0
        yield f"{rows}x{vocab} flat row", flat
        special = x.clone()
        special[0] = -float("inf")
        if rows > 1:
            special[1, vocab // 2] = float("nan")
        if rows > 2:
            special[2, vocab - 1] = float("inf")
        yield f"{rows}x{vocab} inf nan", special


def check_logit_stats(lib) -> int:
    """mtpflow_logit_stats against torch on 1 and 2 threads: argmax exactly, logsumexp to float rounding, the top
    ids holding torch.topk's values with the lower ids first among equal ones (none where a row has a NaN). Returns
    the cases checked."""
    checked = 0
    for name, x in logit_cases():
        k = min(8, x.shape[1])
        for threads in (1, 2):
            argmax, log_norm, top_ids = kernel.logit_stats(x, threads, lib=lib, top=k)
            assert torch.equal(argmax, x.argmax(-1)), name
            torch.testing.assert_close(log_norm, torch.logsumexp(x, -1), rtol=2e-6, atol=2e-6, equal_nan=True,
                                       msg=name)
            assert kernel.logit_stats(x, threads, lib=lib)[2] is None, name  # none asked for
            if bool(x.isnan().any()):
                assert top_ids is None, name  # a row with a NaN: its top ids are torch's to give
                continue
            values = x.gather(1, top_ids)
            assert torch.equal(values, x.topk(k, dim=-1).values), name
            for row, ids, vals in zip(x, top_ids, values):
                for v in vals.unique():  # the ids of one value: the lowest ids that hold it, in order
                    mine = ids[vals == v]
                    assert torch.equal(mine, (row == v).nonzero().flatten()[:mine.numel()]), name
            checked += 1
    return checked


@pytest.mark.parametrize("build", BUILDS)
def test_logit_stats_match_torch(builds, build):
    without_nan = sum(not bool(x.isnan().any()) for _, x in logit_cases())
    assert check_logit_stats(_lib(builds, build)) == 2 * without_nan  # their top ids checked, on 1 and 2 threads


def _runtime(name: str) -> str | None:
    try:
        found = subprocess.run([CC, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = found.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def test_every_entry_point_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """The generic build (no -march: the flags below as they are), the widest one of ISA_FLAGS this CPU runs and
    the -march=native one (this CPU's own paths, VNNI where it has them), with ASan and UBSan, through a few shapes
    of every entry point in a python that preloads ASan's runtime (it must come first in the process); any report
    fails (UBSan does not recover, ASan stops at the first error)."""
    if CC is None:
        pytest.skip("no C compiler to build the sanitized kernels")
    asan = _runtime("libasan.so")
    if asan is None:
        pytest.skip(f"{CC} has no AddressSanitizer runtime (libasan.so; Debian: apt-get install libasan8)")
    widest = [isa for isa in ("avx512", "avx2") if isa in kernel.runnable_isas()][:1]
    flag_sets = {"sanitized-generic": SANITIZE,
                 **{f"sanitized-{isa}": (*SANITIZE, *kernel.ISA_FLAGS[isa]) for isa in widest},
                 "sanitized-native": (*SANITIZE, "-march=native")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        built = dict(zip(flag_sets, pool.map(lambda item: kernel.build(CC, tmp_path / f"{item[0]}.so", item[1]),
                                             flag_sets.items())))
    assert built["sanitized-generic"], f"{CC} cannot build with {' '.join(SANITIZE)}"
    paths = [str(tmp_path / f"{name}.so") for name, ok in built.items() if ok]
    here = Path(__file__).parent
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; import test_native_harness as harness; "
            "harness.sanitizer_subset(sys.argv[3:])")
    env = dict(os.environ, LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1")
    done = subprocess.run([sys.executable, "-c", code, str(here), str(here.parent), *paths], env=env,
                          capture_output=True, text=True, timeout=600)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-6000:]
    assert "Sanitizer" not in report and "runtime error" not in report, report[-6000:]
    assert report.count("checked ") == len(paths), report
