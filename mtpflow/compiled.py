"""A compiled verify forward (``model.compile=true``): ``torch.compile`` over one decoder layer of the lean
Llama forward, for the engine's one batched verify per step, with the KV pool's preallocated buffers as inputs
written in place.

What is compiled: ``_layer``, i.e. ``mtpflow.forward.decoder_layer`` over one layer's pool buffers (where each
row writes, what attention reads), with attention written out (``forward.grouped_attention``). Compiled once,
the same graph serves all layers (they differ in weights, which are graph inputs, not in code): the first
compile of the default model's 30 layers took about 20 s on 2 shared cores instead of about 3 minutes for a
whole-model graph. Every linear stays one opaque op (``mtpflow::packed_linear``: the per-machine plan, the
native or int8 kernel, as eager); Inductor (its C++ backend on a CPU) fuses what lies between them: norms,
rotary embedding, residual adds, SwiGLU, the key and value writes, mask, softmax.

Shapes: the rows of the batch, the draft rows per sequence, the cache length and the pool's capacity are
dynamic, so three graphs (one new entry in all; one per sequence in a batch; drafts) serve every batch size,
draft size and cache length; nothing is padded.

On disk: after a process compiles, Inductor's artifacts (``torch.compiler.save_cache_artifacts``) go to
``<cache>/compiled/<key>.bin`` (keyed by the model's shapes, torch, the CPU and this code), and the next process
loads them before its first compile, so only the first run pays the compile (a later one still traces the
layer with Dynamo: a few seconds). Where compiling fails (no C++ compiler, a model Dynamo cannot trace) the
forward falls back to eager with one line on stderr, once per model.

Prefill and a sequence's own verify stay eager: a prefill runs once per request and its rows would add graphs.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import platform
import sys
import time

import torch

from mtpflow import forward as lean_forward
from mtpflow import kv_cache
from mtpflow.kernels import cpu_linear
from mtpflow.kv_cache import write_rows


def _layer(block, h, cos, sin, mask, keys, values, rows, positions, apply_rotary):
    """One decoder layer over the pool's buffers of that layer: row ``rows[i]`` takes new entry ``i`` at
    ``positions[i]`` (``kv_cache.write_rows``, as the eager batch cache); attention reads rows ``0..B-1`` up to
    the mask's key length. Compiled once, it serves every layer: the layers differ in weights (graph inputs),
    not in code."""

    def update(key, value):
        return write_rows(keys, values, rows, positions, key, value, mask.shape[-1])

    return lean_forward.decoder_layer(block, h, cos, sin, mask, update, apply_rotary, compiled=True)


def enable(model, load_key: str) -> bool:
    """Turn the compiled verify forward on for ``model`` (the first batched verify compiles, or loads what an
    earlier process compiled); a model the lean forward does not run gets one line and stays eager."""
    if not lean_forward.supports(model):
        attn = getattr(model.config, "_attn_implementation", "?")
        print(f"mtpflow: model.compile: {type(model).__name__} on {attn} attention has no compiled forward "
              "(Llama-family models on SDPA only); running eager", file=sys.stderr)
        return False
    cpu_linear.register_for_compile(model)
    model._mtpflow_compiled = Compiled(model, load_key)
    return True


class Compiled:
    """One model's compiled verify forward, its disk cache and its state (compiled, failed, timings)."""

    def __init__(self, model, load_key: str):
        self.model = model
        self.key = load_key
        self.failed: str | None = None
        self.compile_seconds: float | None = None  # the first call: load or compile, and run
        self.loaded_artifacts = False
        self._saved_graphs = 0  # Dynamo's graph count when the artifacts were last written
        self._marked_buffers = None  # the pool's first key buffer when their capacity was marked dynamic
        self._fn = None

    def path(self):
        from mtpflow.kernels.cpu_linear import cpu_name
        from mtpflow.model import measurement_path

        cfg = self.model.config
        key = (self.key, type(self.model).__name__, int(cfg.num_hidden_layers), int(cfg.hidden_size),
               str(self.model.dtype), torch.__version__, platform.machine(), cpu_name(), torch.get_num_threads(),
               getattr(self.model, "_mtpflow_linear_plans", None), _source_hash())
        return measurement_path("compiled", *key).with_suffix(".bin")

    def _load_artifacts(self) -> None:
        try:
            data = self.path().read_bytes()
        except OSError:
            return
        try:
            self.loaded_artifacts = torch.compiler.load_cache_artifacts(data) is not None
        except Exception:  # a damaged or foreign file: compile afresh and overwrite it
            self.loaded_artifacts = False

    def _save_artifacts(self) -> None:
        """Write every artifact of this process (loaded or compiled) again; called when a new graph appeared."""
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception:
            return
        if not saved:
            return
        path = self.path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{id(self)}")
            tmp.write_bytes(saved[0])
            tmp.replace(path)
        except OSError:
            pass  # an unwritable cache only means compiling again next time

    def _build(self):
        self._load_artifacts()
        return torch.compile(_layer, dynamic=False, fullgraph=True)

    def __call__(self, input_ids, position_ids, mask, cache, taps):
        """The compiled forward over a ``BatchCache``; None where it failed (the caller runs eager)."""
        if self.failed:
            return None
        pool = cache.pool
        first = self._fn is None
        t0 = time.perf_counter()
        try:
            if first:
                cpu_linear.register_for_compile(self.model)  # linears a run packed after ``enable``
                self._fn = self._build()
            rows, positions, layer = cache.row_index, cache.position_index, self._fn
            mark = torch._dynamo.maybe_mark_dynamic
            if pool.keys[0] is not self._marked_buffers:  # new buffers (the pool grew): their capacity varies
                self._marked_buffers = pool.keys[0]
                for buf in (*pool.keys, *pool.values):
                    mark(buf, 2)

            def compiled_layer(block, index, h, cos, sin, mask, apply_rotary):
                mark(h, 0), mark(h, 1)  # a new tensor every layer
                if index == 0:
                    _mark_dynamic(cos, sin, mask, rows, positions)
                return layer(block, h, cos, sin, mask, pool.keys[index], pool.values[index], rows, positions,
                             apply_rotary)

            with _size_oblivious():
                out = lean_forward.forward(self.model, input_ids, position_ids, mask, cache, taps,
                                           layer=compiled_layer)
        except Exception as exc:  # noqa: BLE001 - any compile failure falls back to eager, said once
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            self.failed = f"{type(exc).__name__}: {first_line}"
            print(f"mtpflow: model.compile: compiling the verify forward failed, running eager ({self.failed})",
                  file=sys.stderr)
            return None
        if first:
            self.compile_seconds = time.perf_counter() - t0
        graphs = _graph_count()
        if graphs != self._saved_graphs:  # a shape class seen for the first time: a new graph to keep
            self._saved_graphs = graphs
            self._save_artifacts()
        return out


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _mark_dynamic(cos, sin, mask, rows, positions) -> None:
    """The sizes that vary between calls (rows of the batch, draft rows, cache length); the hidden size, heads
    and the mask's head dimension of one stay static. Marks matter when Dynamo traces: a graph compiled later
    for a new shape class must see them too, so every forward marks its inputs (a few microseconds)."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (cos, sin):
        mark(t, 0), mark(t, 1)
    mark(mask, 0), mark(mask, 2), mark(mask, 3), mark(rows, 0), mark(positions, 0)


@contextlib.contextmanager
def _size_oblivious():
    """A dynamic size that is one on the first call stays symbolic (else a batch of one would be baked in), and
    the model's float constants stay constants (a symbolic one made Dynamo trace everything twice)."""
    from torch._dynamo import config as dynamo_config
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True), dynamo_config.patch(specialize_float=True):
        yield


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """The compiled code's own source, in the cache key: a changed forward never loads an old graph."""
    from pathlib import Path

    text = "".join(Path(m.__file__).read_text() for m in (sys.modules[__name__], lean_forward, kv_cache))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def run(model, input_ids, position_ids, attention_mask, cache, taps):
    """``(logits, taps)`` from the compiled forward, or None to run eager (not enabled, or it failed)."""
    compiled = getattr(model, "_mtpflow_compiled", None)
    if compiled is None or attention_mask is None or not hasattr(cache, "row_index"):
        return None
    return compiled(input_ids, position_ids, attention_mask, cache, tuple(taps))


def describe(model) -> dict:
    """The compiled forward's state for stats and the bench: on, failed, first-call seconds, cache loaded."""
    compiled = getattr(model, "_mtpflow_compiled", None)
    if compiled is None:
        return {"compiled": False}
    return {"compiled": compiled.failed is None, "compile_failed": compiled.failed,
            "compile_seconds": compiled.compile_seconds, "compile_cache_loaded": compiled.loaded_artifacts}

