"""Backends: how the target model computes its forwards (``base.Backend`` is the interface).

The engine resolves one ``ExecutionSpec`` from its config (``execution``) and builds its backend here (``create``):
``hf`` (PyTorch over the model's own modules, any model and device: the reference), ``native_cpu`` (mtpflow's C
kernel: ``native/``, float32 models of every family its layer description covers (``native/description.py``) on a
CPU, and the int8 model of ``model.quantize=int8``),
``cuda_graph`` (static shapes, CUDA graphs captured per bucket), or ``auto``: ``native_cpu`` where it applies,
else ``hf``, saying why once. Nothing outside this package imports the native machinery: what the rest of
mtpflow needs of it (``quantize_int8``, the int8 model's torch reference, the rows of a verify forward and the
streamed buffers for the benchmarks) is exported here.
"""
from __future__ import annotations

import functools
import sys

from mtpflow.backends.base import Backend
from mtpflow.backends.execution import ExecutionSpec, check_backend
from mtpflow.backends.hf import HFBackend, reference
from mtpflow.errors import UserError

__all__ = ["Backend", "ExecutionSpec", "create", "int8_draft_backend", "int8_reference", "native_kernels_available",
           "native_not_applicable", "quantize_int8", "reference", "streamed_empty", "verify_rows"]


def native_not_applicable(model) -> str | None:
    """Why the ``native_cpu`` backend cannot run ``model`` (one line), or None where it can."""
    from mtpflow.backends.native import cpu

    return cpu.not_applicable(model)


def quantize_int8(model):
    """``model`` (a model the layer description covers, on the CPU: float32, bfloat16 or float16) as the int8 model
    (``native.int8_reference``), its float32 decoder and head weights freed; a one-line UserError where the
    ``native_cpu`` backend cannot run it."""
    from mtpflow.backends.native import cpu, int8

    return int8.quantize_model(model, cpu.not_applicable(model, int8.SOURCE_DTYPES))


def native_kernels_available() -> bool:
    """Whether mtpflow's C kernels are built (or can be) on this machine."""
    from mtpflow.backends.native import kernel

    return kernel.available()


def int8_draft_backend(model) -> Backend:
    """The int8 model of the float ``model`` on the native CPU backend, to draft with: its int8 weights made from
    ``model``'s own in memory (``model`` is not changed, unlike ``quantize_int8``), its forwards not watched by the
    thread governor (they run on the count the target's forwards decide: ``NativeInt8Backend.governed``). A
    one-line UserError where it cannot run."""
    from mtpflow.backends.native import cpu, int8

    reason = cpu.not_applicable(model, int8.SOURCE_DTYPES)
    if reason is None and not native_kernels_available():
        reason = "mtpflow's C kernel could not be built here"
    if reason is not None:
        raise UserError(f"the int8 draft model does not apply here: {reason}")
    backend = int8.NativeInt8Backend(model, int8.int8_model(model, None))
    backend.governed = False
    return backend


def int8_reference(weights):
    """The int8 model's torch reference (``native.int8_reference.Int8Reference``) over the weights
    ``quantize_int8`` made: what "lossless" means over the int8 model (its greedy, one token at a time)."""
    from mtpflow.backends.native.int8_reference import Int8Reference

    return Int8Reference(weights)


def verify_rows(targets, roots, drafts, root_positions):
    """The rows of one verify forward as the native decoder stacks take them (``native.rows.VerifyRows``): what a
    benchmark hands a native backend's parts to time them alone."""
    from mtpflow.backends.native.rows import verify_rows as rows

    return rows(targets, roots, drafts, root_positions)


def streamed_empty(numel: int, dtype):
    """A 1-D tensor on huge pages where the system grants them (``native.memory.streamed_empty``: where the int8
    weights and the panel copies lie): what a benchmark reads the host's bandwidth over."""
    from mtpflow.backends.native.memory import streamed_empty as empty

    return empty(numel, dtype)


def create(model, spec: ExecutionSpec | str | None = None, int8=None, **choices) -> Backend:
    """The backend ``spec`` asks for, over ``model`` (``int8``: the int8 model's weights when it was loaded with
    ``model.quantize=int8``: only ``native_cpu`` runs it). ``spec`` may be a backend name, with other fields of the
    spec as keywords (``create(model, "native_cpu", certified_head=False)``: tools and tests). An explicit backend
    that does not apply to the model is a one-line UserError; ``auto`` that cannot take ``native_cpu`` on a CPU
    says why once (stderr)."""
    if spec is None or isinstance(spec, str):
        spec = ExecutionSpec(backend=check_backend(spec or "auto"), **choices)
    name = spec.backend
    backend = None
    if int8 is not None:
        if name not in ("auto", "native_cpu"):
            raise UserError(f"model.quantize=int8 runs on the native_cpu backend, not model.backend={name} "
                            "(use model.backend=auto or native_cpu)")
        from mtpflow.backends.native.int8 import NativeInt8Backend

        try:
            backend = NativeInt8Backend(model, int8)
        except ValueError as why:
            raise UserError(f"model.quantize=int8 does not apply here: {why}") from None
    elif name == "cuda_graph":
        from mtpflow.backends import cuda_graph

        reason = cuda_graph.not_applicable(model)
        if reason is not None:
            raise UserError(f"model.backend=cuda_graph does not apply here: {reason} (use model.backend=hf or auto)")
        backend = cuda_graph.CUDAGraphBackend(model, capacity=spec.graph_capacity, rows=spec.graph_rows)
    elif name in ("auto", "native_cpu"):
        reason = native_not_applicable(model)
        if reason is None:
            from mtpflow.backends.native.cpu import NativeCPUBackend

            backend = NativeCPUBackend(model, certified_head=spec.certified_head)
        elif name == "native_cpu":
            raise UserError(f"model.backend=native_cpu does not apply here: {reason} (use model.backend=hf or auto)")
        elif next(model.parameters()).device.type == "cpu":
            _say_once(f"mtpflow: model.backend=auto runs hf (PyTorch): the native_cpu backend does not apply: {reason}")
    if backend is None:
        backend = reference(model, spec)
    backend.spec = spec
    return backend


@functools.lru_cache(maxsize=None)
def _say_once(line: str) -> None:
    """Print ``line`` to stderr the first time it comes in this process (an engine per request must not repeat it)."""
    print(line, file=sys.stderr, flush=True)
