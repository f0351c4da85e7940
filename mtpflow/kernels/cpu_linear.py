"""Small-batch linear layers for the CPU verify forward: oneDNN with pre-packed weights.

Why: decoding on a CPU is bound by reading the weights. PyTorch's ``F.linear`` on float32 CPU tensors goes to
MKL, which for 2 to 4 rows runs close to one matrix-vector product per row, so it reads the weights once per
row: on the 2-core machine this was built on, a 3-token forward of SmolLM2-135M took 2.1x a 1-token one. A
verify forward feeds 1 + K rows, so that cost ate most of what speculation gains. oneDNN's inner-product
primitive over a weight packed once into its blocked layout reads the weights once for all rows
(``python -m mtpflow.bench mode=cost`` shows the curve either way; ``model.cpu_linear`` switches it).

For one row, MKL's stock path on that machine was itself slower than a product with a transposed copy of the
weight (7-27% of a whole one-token forward across runs); ``install`` times both on the model's largest linear and
keeps the faster for the stock path. One row is also a row count the plans below are timed for: on the 2-core
AMD EPYC host the native kernel ran a one-token decode step of the default model in 72 ms against 110 ms for
the best stock path and 119 ms for ``model.generate``'s (median of 15, after a 200-token prefill), so plain
decode steps (K = 0) gain too.

Which path wins for several rows depends on the CPU: on that AMD machine oneDNN won everywhere, on an Intel
Xeon with AVX-512 stock MKL ran 2-3 rows through the whole model in about the time of one (37 vs 52 ms with
oneDNN, whose per-call overhead dominates the small layers), and oneDNN won only on the LM head from 3 rows
up. Neither reads the weights at memory speed for a few rows, so a fourth path is mtpflow's own kernel
(``native_linear``: ``small_gemm.c``, compiled on first use), which on that Xeon ran 5 rows through the
whole model in 36 ms against 49 ms for the best of the others and about 33 ms for one row. ``install`` times
whole-model forwards of 1, 2, 3, 5, 9, 17 and 64 rows (verifies as the loop runs them, a prefill for 64) under
four *plans* -- stock everywhere, packed everywhere, packed on the largest linear (the LM head) only, native
everywhere (where it could be built) -- and keeps the fastest per row count (42-55 s at first load for the
default model on a busy 2-core AVX2 host);
the choice is cached per CPU, torch build, thread count and layer shapes under ``~/.cache/mtpflow/cpu_linear``.
The 64-row entry
covers every larger forward too (a prompt's prefill, a wide batched verify): on a 2-core AMD EPYC with
AVX-512 (Zen 5), MKL ran 64-128 rows at about 200 GFLOP/s and oneDNN and the native kernel at 420-490, so a
64-row forward of the default model took 136 ms stock, 67 packed, 59 native.

How: ``install(model)`` turns every ``nn.Linear`` of the model into a ``PackedLinear`` (the same object with
its class swapped, so parameters, tied weights, hooks and ``isinstance`` checks are unchanged). Outside a
``packed()`` block a ``PackedLinear`` is exactly ``nn.Linear`` (so ``model.generate`` in the same process is
stock HF); inside one, float32 CPU inputs take the paths above. The packed (and transposed) copies are built
on first use and rebuilt when the weight changes; each costs one more copy of the linear weights in memory.

Numerics: a different summation order than MKL, differences around 1e-6 relative (the same order as MKL's own
differences between 1-row and many-row products); greedy outputs stay token-identical in the tests.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import platform
import statistics
import time
import weakref
from typing import Iterator

import torch
import torch.nn.functional as F

from mtpflow.kernels import native_linear

MODES = ("auto", "packed", "stock")
# "auto" packs only models whose linear weights fit this budget (the packed copy doubles their memory)
AUTO_MAX_BYTES = 1024**3

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("mtpflow_packed_linear", default=False)

# row counts timed by ``time_plans`` (1 + K for K = 0, 1, 2, 4, 8, 16, and 64 for a prompt's prefill or a wide
# batched verify); a forward of r rows follows the plan of the smallest entry >= r (the last one beyond it)
ROW_BUCKETS = (1, 2, 3, 5, 9, 17, 64)
# multi-row path: stock MKL, oneDNN everywhere, oneDNN on the largest only, the native kernel everywhere
PLANS = ("stock", "packed", "head", "native")
# where no timing chose (small or untimable models): one row stock, several rows oneDNN
DEFAULT_PLANS = ("stock",) + ("packed",) * (len(ROW_BUCKETS) - 1)


def available_plans() -> tuple[str, ...]:
    """PLANS that can run here (``native`` needs the kernel built: ``native_linear.available``)."""
    return PLANS if native_linear.available() else tuple(p for p in PLANS if p != "native")


def bucket(rows: int) -> int:
    """Index in ROW_BUCKETS of the plan a ``rows``-row forward follows."""
    for i, r in enumerate(ROW_BUCKETS):
        if rows <= r:
            return i
    return len(ROW_BUCKETS) - 1


# bucket(rows) for rows up to the largest entry, looked up on every multi-row linear call of a verify forward
_BUCKET_OF = tuple(bucket(r) for r in range(ROW_BUCKETS[-1] + 1))
# ``time_plans`` times every bucket but the last as a verify (a root + a chain) and the last as a prefill: the
# widest verify bucket (17 rows), whose plan verifies wider than it follow (``forward._RowSpec.ready``)
WIDEST_VERIFY_BUCKET = len(ROW_BUCKETS) - 2


def available() -> bool:
    """Whether this torch build has the oneDNN packed linear ops."""
    return bool(torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose float32 CPU forward, inside ``packed()``, takes the path its plan names for that
    row count (stock ``F.linear``, oneDNN over a packed weight, or the native kernel); one row on the stock
    path is either ``F.linear`` or a product with a transposed copy of the weight, whichever ``install`` timed
    faster on this machine (MKL's one-row path differs by weight layout)."""

    _mtpflow_pack: tuple | None = None  # (weight version key, packed weight)
    _mtpflow_t: tuple | None = None  # (weight version key, weight.t().contiguous())
    _mtpflow_panels: tuple | None = None  # (weight version key, native_linear.pack_panels(weight))
    _mtpflow_int8: tuple | None = None  # (q int8 [out, in], scale [out]) once ``quantize`` ran: every row count
    _mtpflow_one_row_transposed = False
    # per entry of ROW_BUCKETS, the path for that many rows: "stock" (F.linear), "packed" (oneDNN), "native"
    _mtpflow_row_paths: tuple[str, ...] = DEFAULT_PLANS

    def _key(self) -> tuple:
        w = self.weight
        return (w.data_ptr(), w._version, tuple(w.shape))

    def _transposed_weight(self) -> torch.Tensor:
        key = self._key()
        if self._mtpflow_t is None or self._mtpflow_t[0] != key:
            self._mtpflow_t = (key, self.weight.detach().t().contiguous())
        return self._mtpflow_t[1]

    def _packed_weight(self) -> torch.Tensor:
        key = self._key()
        if self._mtpflow_pack is None or self._mtpflow_pack[0] != key:
            with torch.no_grad():
                self._mtpflow_pack = (key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None))
        return self._mtpflow_pack[1]

    def _panels(self) -> torch.Tensor:
        key = self._key()
        if self._mtpflow_panels is None or self._mtpflow_panels[0] != key:
            self._mtpflow_panels = (key, native_linear.pack_panels(self.weight))
        return self._mtpflow_panels[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled forward (mtpflow.compiled): one opaque op per linear
            return torch.ops.mtpflow.packed_linear(x, self.weight, self.bias)
        return self._eager(x)

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        if not _active.get() or x.device.type != "cpu" or x.dtype != torch.float32 \
                or self.weight.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if self._mtpflow_int8 is not None:
            return native_linear.linear_int8(x, *self._mtpflow_int8, self.bias)
        rows = x.numel() // x.shape[-1]
        path = self._mtpflow_row_paths[_BUCKET_OF[rows] if rows < len(_BUCKET_OF) else -1]
        if path == "stock":
            if rows == 1 and self._mtpflow_one_row_transposed:
                y = x @ self._transposed_weight()
                return y if self.bias is None else y + self.bias
            return F.linear(x, self.weight, self.bias)
        if path == "native":
            panels = self._panels() if rows >= native_linear.panel_min_rows() else None
            return native_linear.linear(x, self.weight, self.bias, panels)
        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        bias = None if self.bias is None else self.bias.detach()
        y = torch.ops.mkldnn._linear_pointwise(rows, self._packed_weight(), bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


class FusedLinear(PackedLinear):
    """Several PackedLinears that read the same input (a layer's query, key and value projections; an MLP's gate
    and up projections) as one product: ``fuse`` concatenates their weights once and makes each part's weight a
    view into the result, so memory does not grow and the parts keep working alone (HF's own forward). One call
    instead of three reads the input once and lets the kernel block over the wider output: at 16 rows on a 2-core
    AVX2 host the default model's 30 layers of linears took 52 ms fused against 61 ms apart (oneDNN, weights
    streamed from memory). It follows its first part's plan; ``split`` returns each part's output (views)."""

    _mtpflow_parts: tuple = ()
    _mtpflow_ptrs: tuple = ()  # where each part's weight starts inside the fused one

    @property
    def _mtpflow_row_paths(self):
        return self._mtpflow_parts[0]._mtpflow_row_paths

    @property
    def _mtpflow_one_row_transposed(self):
        return self._mtpflow_parts[0]._mtpflow_one_row_transposed

    def ready(self) -> bool:
        """Whether the fused product computes the parts now: inside ``packed()``, no part quantized, every part's
        weight still the view ``fuse`` made (a part given a new weight is used alone). Called per layer and
        forward, so it reads the parameters dict directly (1.3 us for three parts; 7.5 us through ``part.weight``)."""
        if not _active.get():
            return False
        for part, ptr in zip(self._mtpflow_parts, self._mtpflow_ptrs):
            if part._mtpflow_int8 is not None or part._parameters["weight"].data_ptr() != ptr:
                return False
        return True

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split([part.out_features for part in self._mtpflow_parts], dim=-1)


def fuse(parts: list[torch.nn.Module]) -> FusedLinear | None:
    """One ``FusedLinear`` over ``parts`` (PackedLinears of the same input size, dtype and device, all with or all
    without bias, none quantized), or None where they cannot be fused. Each part's weight becomes a view into
    the concatenated weight; the parts' own packed copies are dropped (the fused one builds its own)."""
    first = parts[0]
    if len(parts) < 2 or not all(type(p) is PackedLinear and p._mtpflow_int8 is None for p in parts):
        return None
    if any(p.in_features != first.in_features or p.weight.dtype != first.weight.dtype
           or p.weight.device != first.weight.device or (p.bias is None) != (first.bias is None) for p in parts):
        return None
    with torch.inference_mode(False), torch.no_grad():  # a normal tensor (its version is the cache key) even when
        weight = torch.cat([p.weight.detach() for p in parts])  # fused inside a decode's inference mode
        bias = torch.cat([p.bias.detach() for p in parts]) if first.bias is not None else None
        fused = FusedLinear.__new__(FusedLinear)
        torch.nn.Module.__init__(fused)
        fused.in_features, fused.out_features = first.in_features, int(weight.shape[0])
        fused.weight = torch.nn.Parameter(weight, requires_grad=False)
        fused.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
        start = 0
        for p in parts:
            n = p.out_features
            p.weight.data = weight[start : start + n]
            if bias is not None:
                p.bias.data = bias[start : start + n]
            p._mtpflow_pack = p._mtpflow_t = p._mtpflow_panels = None
            start += n
    fused._mtpflow_parts = tuple(parts)
    fused._mtpflow_ptrs = tuple(p.weight.data_ptr() for p in parts)
    return fused


# weight storage address -> PackedLinear, for the custom op below: an op takes tensors, not modules, so the op
# finds its module by the weight it is given (an address, not a number baked into the graph: a graph must be
# the same in every process for the disk cache to hit). Weak: a dropped model leaves nothing behind.
_COMPILED_LINEARS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register_for_compile(model: torch.nn.Module) -> None:
    """Make ``model``'s PackedLinears callable from a compiled graph (``mtpflow::packed_linear``)."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            _COMPILED_LINEARS[m.weight.data_ptr()] = m


@torch.library.custom_op("mtpflow::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A PackedLinear's own path (its per-row-count plan, the native or int8 kernel) as one op that
    ``torch.compile`` does not trace into: Inductor fuses what lies between the linears and calls this for each."""
    with packed():
        return _COMPILED_LINEARS[weight.data_ptr()]._eager(x)


@_packed_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_bytes(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, torch.nn.Linear))


def should_pack(mode: str, model: torch.nn.Module) -> bool:
    """Whether ``mode`` (auto | packed | stock) packs this model's linears: auto packs float32 CPU models
    whose linear weights fit ``AUTO_MAX_BYTES``, when oneDNN is available."""
    if mode == "stock":
        return False
    if is_quantized(model):
        return True  # int8 linears run only inside packed(), whatever their size
    if not available():
        return False
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        return False
    return mode == "packed" or linear_bytes(model) <= AUTO_MAX_BYTES


def install(model: torch.nn.Module, plans: tuple[str, ...] | None = None) -> int:
    """Swap every ``nn.Linear`` of ``model`` to ``PackedLinear`` in place (idempotent) and apply the plan per
    entry of ROW_BUCKETS (``plans``, or timed by ``load_plans``; ``apply_plans`` also chooses the one-row stock
    path); returns how many were swapped."""
    fresh = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not fresh:
        return 0
    for module in fresh:
        module.__class__ = PackedLinear
    apply_plans(model, plans if plans is not None else load_plans(model))
    drop_unused_copies(model)  # what timing the plans built for paths not chosen
    return len(fresh)


def apply_plans(model: torch.nn.Module, plans: tuple[str, ...]) -> None:
    """Set every PackedLinear of ``model`` to ``plans`` (one of PLANS per entry of ROW_BUCKETS); ``native``
    where the kernel cannot be built here runs stock."""
    if len(plans) != len(ROW_BUCKETS) or any(p not in PLANS for p in plans):
        raise ValueError(f"plans must be {len(ROW_BUCKETS)} of {PLANS}, got {plans!r}")
    mods = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not mods:
        return
    largest = max(mods, key=lambda m: m.weight.numel())
    native = native_linear.available()

    def path(plan: str, m: torch.nn.Module) -> str:
        if plan == "packed" or (plan == "head" and m is largest):
            return "packed"
        return "native" if plan == "native" and native else "stock"

    for m in mods:
        m._mtpflow_row_paths = tuple(path(p, m) for p in plans)
    model._mtpflow_linear_plans = tuple(plans)
    if any(m._mtpflow_row_paths[0] == "stock" for m in mods):
        choose_one_row_path(model)


def choose_one_row_path(model: torch.nn.Module) -> None:
    """Time once per model (``one_row_transposed_is_faster`` on the largest linear) whether one row on the stock
    path takes the transposed weight copy, and set every PackedLinear's choice. ``apply_plans`` calls it where a
    one-row forward takes the stock path (also while ``time_plans`` tries the stock plans), so a load whose
    cached plans run one row natively skips it (0.28 s of each load of the default model)."""
    if "_mtpflow_one_row_t" not in model.__dict__:
        mods = [m for m in model.modules() if isinstance(m, PackedLinear)]
        faster = bool(mods) and one_row_transposed_is_faster(max(mods, key=lambda m: m.weight.numel()))
        model.__dict__["_mtpflow_one_row_t"] = faster
    for m in model.modules():
        if type(m) is PackedLinear:  # a FusedLinear follows its first part
            m._mtpflow_one_row_transposed = model.__dict__["_mtpflow_one_row_t"]


def drop_unused_copies(model: torch.nn.Module) -> None:
    """Free the oneDNN packed copies and native panels that no row count's path uses any more (timing all
    plans builds every kind; each is a full copy of the linear weights), the fused products' included (held
    outside the module tree, in their block's ``__dict__``: ``mtpflow.forward.fuse_projections``)."""
    fused = [v for m in model.modules() for v in vars(m).values() if isinstance(v, FusedLinear)]
    for m in [*model.modules(), *fused]:
        if isinstance(m, PackedLinear):
            if "packed" not in m._mtpflow_row_paths:
                m._mtpflow_pack = None
            if "native" not in m._mtpflow_row_paths:
                m._mtpflow_panels = None
            if m._mtpflow_row_paths[0] != "stock":
                m._mtpflow_t = None  # the transposed copy serves only one row on the stock path


@torch.inference_mode()
def time_plans(model: torch.nn.Module, repeats: int = 7) -> dict[tuple[int, str], list[float]]:
    """{(rows, plan): seconds of each repeat} of the forward a step of ``rows`` rows runs under each plan, through
    ``mtpflow.target.Target`` as decoding runs it: a verify of a root and a chain of ``rows - 1`` random drafts
    over a one-token prefix (where the plan and the model allow, every layer in one native call:
    ``forward.native_rows``) for the verify buckets, a prefill of that many tokens (the last row's logits only)
    for the largest. Plans interleaved so background load hits them alike, after a warm-up round;
    ``load_plans`` keeps the fastest repeat (a median still moved the choice between runs on a 2-core host)."""
    from mtpflow.target import Target
    from mtpflow.types import Draft

    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if vocab <= 0:
        return {}
    g = torch.Generator().manual_seed(0)
    saved = getattr(model, "_mtpflow_linear_plans", None)
    out: dict[tuple[int, str], list[float]] = {}
    target = Target(model)
    token = _active.set(True)
    try:
        target.prefill(torch.randint(0, vocab, (1,), generator=g))  # the one-token prefix every verify sees
        for rows in ROW_BUCKETS:
            ids = torch.randint(0, vocab, (rows + 1,), generator=g)
            chain = Draft(ids[2:], torch.arange(-1, rows - 2)) if rows > 1 else Draft.empty()
            for i in range(repeats + 1):
                for plan in available_plans():
                    apply_plans(model, (plan,) * len(ROW_BUCKETS))
                    target.cache_len = 0 if rows == ROW_BUCKETS[-1] else 1  # rolled back by position
                    t0 = time.perf_counter()
                    if rows == ROW_BUCKETS[-1]:
                        target.prefill(ids[:rows])
                    else:
                        target.verify(int(ids[1]), chain, 1)
                    if i:  # the first round warms up (and packs the weights)
                        out.setdefault((rows, plan), []).append(time.perf_counter() - t0)
    finally:
        _active.reset(token)
        target.release()
        if saved is not None:
            apply_plans(model, saved)
            drop_unused_copies(model)  # (a first install drops them after applying its plans)
    return out


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform``): measurements of CPU speed are kept per CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# what ``time_plans`` times (part of the cache key: plans timed through HF's forward, before, are timed again)
TIMED = "target-verify"


def _plans_cache_path(model: torch.nn.Module):
    from mtpflow.model import measurement_path

    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    return measurement_path("cpu_linear", TIMED, cpu_name(), os.cpu_count(), torch.get_num_threads(),
                            torch.__version__, ROW_BUCKETS, available_plans(), _native_version(), [list(s) for s in shapes])


def _native_version() -> str:
    """The native kernels' version where they are built here, else "" (part of the cache keys)."""
    return native_linear.source_hash()[:10] if native_linear.available() else ""


def fastest_plans(ms: dict[int, dict[str, float]]) -> tuple[str, ...]:
    """The fastest plan per entry of ROW_BUCKETS from timings ``{rows: {plan: time}}``."""
    return tuple(min(ms[r], key=ms[r].get) for r in ROW_BUCKETS)


def load_plans(model: torch.nn.Module) -> tuple[str, ...]:
    """The fastest plan per entry of ROW_BUCKETS on this machine: read from the cache, else timed
    (``time_plans``, 13-30 s for the 135M default model on a 2-core CPU) and stored (a timing on a busy CPU is
    stored marked, and timed again by a later load on a quiet one: ``mtpflow.model.cached_timing``). Models too small for
    a timing to mean anything (under 4 MB of linear weights, cache-resident), and models whose plain forward
    cannot be timed, keep DEFAULT_PLANS (stock for one row, oneDNN packed for several). The choice from the times
    is ``fastest_plans``."""
    if linear_bytes(model) < 4 << 20:
        return DEFAULT_PLANS
    from mtpflow.model import cached_timing

    def parse(stored: dict):
        ms = {int(r): {p: float(v) for p, v in by_plan.items()} for r, by_plan in stored["ms"].items()}
        plans = fastest_plans(ms) if set(ms) == set(ROW_BUCKETS) else ()
        return plans if len(plans) == len(ROW_BUCKETS) and all(p in available_plans() for p in plans) else None

    def measure():
        try:
            return time_plans(model)
        except (TypeError, ValueError, RuntimeError, AttributeError):  # a forward that wants more than input_ids
            return None

    def record(fastest: dict[tuple[int, str], float]):
        by_rows = {r: {p: v for (rows, p), v in fastest.items() if rows == r} for r in ROW_BUCKETS}
        plans = fastest_plans(by_rows)
        ms = {str(r): {p: round(1000 * v, 2) for p, v in by_rows[r].items()} for r in ROW_BUCKETS}
        return plans, {"plans": list(plans), "rows": list(ROW_BUCKETS), "ms": ms}

    plans, _ = cached_timing(_plans_cache_path(model), parse, measure, record)
    return plans or DEFAULT_PLANS


@torch.inference_mode()
def one_row_transposed_is_faster(layer: torch.nn.Linear, repeats: int = 9, margin: float = 0.05) -> bool:
    """Time one row through ``layer`` (the model's largest linear, too big for the caches, so the timing
    reflects reading the weight from memory) as stock ``F.linear`` and as ``x @ weight.t().contiguous()``,
    interleaved; True when the second is faster by ``margin``. On the 2-core AMD build machine it was ~2x
    faster on the LM head and ~7% faster over a whole forward; other CPUs may differ, hence the timing."""
    w = layer.weight.detach()
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.numel() < 1 << 20:
        return False  # small layers: cache-resident, a timing would mislead; keep stock
    wt = w.t().contiguous()
    x = torch.randn(1, w.shape[1])
    stock, transposed = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        F.linear(x, w)
        t1 = time.perf_counter()
        x @ wt
        t2 = time.perf_counter()
        if i:  # the first round warms up
            stock.append(t1 - t0)
            transposed.append(t2 - t1)
    return statistics.median(transposed) < (1 - margin) * statistics.median(stock)


QUANTIZE = ("int8",)


def check_quantize(kind) -> str | None:
    """``model.quantize``: None or one of QUANTIZE (a one-line ConfigError otherwise)."""
    from mtpflow.errors import ConfigError

    if kind is not None and kind not in QUANTIZE:
        raise ConfigError(f"model.quantize must be null or one of {', '.join(QUANTIZE)}, got {kind!r}")
    return kind


def is_quantized(model: torch.nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) and m._mtpflow_int8 is not None for m in model.modules())


def quantize(model: torch.nn.Module, kind: str) -> int:
    """Weight-only ``int8`` for every linear of ``model`` (made a ``PackedLinear`` here if ``install`` has not
    run: no plans are timed, int8 takes every row count): symmetric, one scale per output feature
    (``native_linear.quantize_int8``). The float weights are replaced by their dequantized
    values (``q * scale``), so everything outside ``packed()`` (``model.generate``, the embedding a tied LM
    head shares) computes the same quantized model in float32 and is the reference "in the same dtype"; inside
    ``packed()`` every row count runs the int8 kernel, which reads a quarter of the bytes. The int8 copy is
    kept beside the float weights (+25% memory). Returns how many linears were quantized."""
    from mtpflow.errors import UserError

    if check_quantize(kind) is None:
        return 0
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        raise UserError("model.quantize=int8 runs float32 models on the CPU (set model.device=cpu, model.dtype=float32)")
    if not native_linear.available():
        raise UserError("model.quantize=int8 needs mtpflow's native CPU kernel, which could not be built here "
                        "(no C compiler, or MTPFLOW_NATIVE=0)")
    if any(type(m) is torch.nn.Linear for m in model.modules()):
        install(model, plans=DEFAULT_PLANS)  # the float plans are never used once quantized: not timed
    mods = [m for m in model.modules() if isinstance(m, PackedLinear)]
    with torch.no_grad():
        for m in mods:
            if m._mtpflow_int8 is None:
                q, scale = native_linear.quantize_int8(m.weight)
                m.weight.copy_(q.float() * scale[:, None])  # in place: a tied embedding shares the values
                m._mtpflow_int8 = (q, scale)
            m._mtpflow_pack = m._mtpflow_t = m._mtpflow_panels = None  # the float paths are unused now
    return len(mods)


def state(model: torch.nn.Module) -> str:
    """"stock", or "packed" / "packed+t1" (with the transposed one-row path) followed by the plans
    per row count when they are not DEFAULT_PLANS (e.g. "packed+t1[stock,stock,stock,head,head,head]"), and the native
    kernels' version where a plan uses them: which linears a forward of ``model`` here would use; part of
    the verify-cost cache key."""
    mods = [m for m in model.modules() if isinstance(m, PackedLinear)] if _active.get() else []
    if not mods:
        return "stock"
    transposed = any(m._mtpflow_one_row_transposed and m._mtpflow_row_paths[0] == "stock" for m in mods)
    name = "packed+t1" if transposed else "packed"
    plans = getattr(model, "_mtpflow_linear_plans", None)
    if plans and tuple(plans) != DEFAULT_PLANS:
        name += "[" + ",".join(plans) + "]"
    if plans and "native" in plans and _native_version():
        name += " native:" + _native_version()  # a changed kernel is measured anew
        if plans[0] == "native" and native_linear.rows_enabled():
            name += " rows"  # verify forwards through mtpflow_llama_rows (mtpflow.forward.native_rows)
    if any(m._mtpflow_int8 is not None for m in mods):
        name = "int8 native:" + _native_version()  # every row count takes the int8 kernel
    return name


def check_mode(name) -> str:
    from mtpflow.errors import ConfigError

    if name not in MODES:
        raise ConfigError(f"model.cpu_linear must be one of {', '.join(MODES)}, got {name!r}")
    return str(name)


def prepare(model: torch.nn.Module, mode: str) -> bool:
    """Install packed linears on ``model`` when ``mode`` asks for them; True when runs should enable them."""
    if not should_pack(check_mode(mode), model):
        return False
    install(model)
    return True


@contextlib.contextmanager
def packed(enabled: bool = True) -> Iterator[None]:
    """Run the body with packed linears on (for this thread / context)."""
    token = _active.set(bool(enabled))
    try:
        yield
    finally:
        _active.reset(token)


def active() -> bool:
    """Whether packed linears are on here (inside ``packed()``)."""
    return _active.get()
