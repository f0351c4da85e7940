"""Backends: how the target model computes its forwards (``base.Backend`` is the interface).

``model.backend`` picks one per engine: ``hf`` (PyTorch over the model's own modules, any model and device: the
reference), ``native_cpu`` (mtpflow's C kernels: Llama-family float32 models on a CPU, and the int8 model of
``model.quantize=int8``: ``native_int8``), ``cuda_graph`` (static
shapes, CUDA graphs captured per bucket; Llama-family models; graphs off on a CPU), or ``auto``: ``native_cpu``
where it applies, else ``hf``.
"""
from __future__ import annotations

import torch

from mtpflow.backends.base import Backend
from mtpflow.backends import cuda_graph, native_cpu, native_int8
from mtpflow.backends.hf import HFBackend
from mtpflow.backends.native_cpu import not_applicable as native_cpu_not_applicable
from mtpflow.errors import ConfigError, UserError
from mtpflow.kernels.int8_reference import Int8Weights

__all__ = ["Backend", "HFBackend", "NAMES", "check_name", "create", "native_cpu_not_applicable", "quantize_int8",
           "row_linear"]

NAMES = ("auto", "hf", "native_cpu", "cuda_graph")


def check_name(name) -> str:
    """``model.backend``: one of NAMES (one line otherwise)."""
    if name not in NAMES:
        raise ConfigError(f"model.backend must be one of {', '.join(NAMES)}, got {name!r}")
    return str(name)


def quantize_int8(model) -> Int8Weights:
    """``model`` (a Llama-family model on the CPU: float32, bfloat16 or float16) as the int8 model (``mtpflow.kernels.int8_reference``),
    its float32 decoder and head weights freed; a one-line UserError where the ``native_cpu`` backend cannot run
    it."""
    return native_int8.quantize_model(model, native_cpu.not_applicable(model, native_int8.SOURCE_DTYPES))


def create(model, name: str = "auto", int8: Int8Weights | None = None, certified_head: bool = True,
           graph_capacity: int = 2048, graph_rows=cuda_graph.ROW_BUCKETS) -> Backend:
    """The backend ``name`` for ``model`` (``int8``: the int8 model's weights when it was loaded with
    ``model.quantize=int8``: only ``native_cpu`` runs it; ``graph_capacity`` / ``graph_rows``: the ``cuda_graph``
    backend's KV capacity and row buckets). An explicit backend that does not apply to the model is a one-line
    UserError."""
    name = check_name(name)
    if int8 is not None:
        if name not in ("auto", "native_cpu"):
            raise UserError(f"model.quantize=int8 runs on the native_cpu backend, not model.backend={name} "
                            "(use model.backend=auto or native_cpu)")
        try:
            return native_int8.NativeInt8Backend(model, int8)
        except ValueError as why:
            raise UserError(f"model.quantize=int8 does not apply here: {why}") from None
    if name == "cuda_graph":
        reason = cuda_graph.not_applicable(model)
        if reason is not None:
            raise UserError(f"model.backend=cuda_graph does not apply here: {reason} (use model.backend=hf or auto)")
        return cuda_graph.CUDAGraphBackend(model, capacity=graph_capacity, rows=graph_rows)
    if name == "hf":
        return HFBackend(model)
    reason = native_cpu.not_applicable(model)
    if reason is None:
        return native_cpu.NativeCPUBackend(model, certified_head=certified_head)
    if name == "native_cpu":
        raise UserError(f"model.backend=native_cpu does not apply here: {reason} (use model.backend=hf or auto)")
    return HFBackend(model)


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a few rows against a large float32 CPU weight (a draft head's vocabulary
    projection): the native row kernel where it is built (it reads the weight once for all rows), else torch."""
    from mtpflow.kernels import native_linear

    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled() \
            and native_linear.available():
        return native_linear.linear(x, weight)
    return x @ weight.T
