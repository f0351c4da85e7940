"""How the target computes, decided in one place: ``ExecutionSpec``, resolved once from the config's ``model`` group
and ``kernels``, validated there with one-line errors.

Every key that picks the execution path is read here and nowhere else: ``model.backend``, ``model.quantize``,
``model.certified_head``, ``model.lean_forward``, ``model.graph_capacity``, ``model.graph_rows``, ``model.device``,
``model.dtype``, ``model.attn_implementation`` and ``kernels`` (the draft-tree ops' implementation). The engine
loads the model and builds its backend from the spec (``mtpflow.backends.create``); the backend's ``describe()``
(the spec's choice plus the kernel that runs it) keys the tuning profile. No environment variable changes the
numerics: the variables that remain (docs/environment.md) choose a compiler, a cache folder, a profile file or how
idle threads wait.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpflow.errors import ConfigError, check_int

BACKENDS = ("auto", "hf", "native_cpu", "cuda_graph")
QUANTIZE = ("int8",)
DTYPES = ("auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16")
IMPLS = ("auto", "torch", "triton")  # the draft-tree ops' implementation (``kernels``)
GRAPH_ROWS = (1, 2, 4, 8, 16, 32, 64)  # cuda_graph's default row buckets


def check_backend(name) -> str:
    """``model.backend``: one of BACKENDS (one line otherwise)."""
    if name not in BACKENDS:
        raise ConfigError(f"model.backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return str(name)


def check_quantize(kind) -> str | None:
    """``model.quantize``: None or one of QUANTIZE (a one-line ConfigError otherwise)."""
    if kind is not None and kind not in QUANTIZE:
        raise ConfigError(f"model.quantize must be null or one of {', '.join(QUANTIZE)}, got {kind!r}")
    return kind


def check_flag(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def check_graph_rows(rows, capacity: int) -> tuple[int, ...]:
    """``model.graph_rows``: ascending row buckets (root + draft nodes per sequence), each 1..capacity / 2."""
    try:
        buckets = tuple(sorted({int(r) for r in rows}))
        whole = all(float(r) == int(r) for r in rows)
    except (TypeError, ValueError):
        buckets, whole = (), False
    if not buckets or not whole or buckets[0] < 1 or buckets[-1] > capacity // 2:
        raise ConfigError(f"model.graph_rows must be whole numbers from 1 to {capacity // 2} (half the KV capacity "
                          f"{capacity}), got {list(rows) if hasattr(rows, '__iter__') else rows!r}")
    return buckets


def resolve_device(device: str) -> torch.device:
    """The torch device for ``model.device`` (auto, cpu, cuda, cuda:N, mps), or one UserError line when this
    machine has no such device: checked before anything is loaded."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(str(device))
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"model.device: unknown device {device!r} (use auto, cpu, cuda or cuda:N)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"model.device={device} but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"model.device={device} but this machine has {count} CUDA device"
                            f"{'' if count == 1 else 's'} (cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError(f"model.device={device} but MPS is not available on this machine")
    return dev


@dataclass(frozen=True)
class ExecutionSpec:
    """What computes the target's forwards, as the user asked for it (``auto`` values are resolved against the model
    when the backend is built: ``mtpflow.backends.create``)."""

    backend: str = "auto"               # model.backend: auto | hf | native_cpu | cuda_graph
    quantize: str | None = None         # model.quantize: None | int8 (the int8 model, native_cpu only)
    certified_head: bool = True         # model.certified_head: greedy rows may take the certified int8 LM head
    lean_forward: bool = True           # model.lean_forward: Llama-family models' torch forward without HF's glue
    device: str = "auto"                # model.device: auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"                 # model.dtype
    attn_implementation: str = "auto"   # model.attn_implementation
    graph_capacity: int = 2048          # model.graph_capacity: cuda_graph's KV entries per sequence
    graph_rows: tuple[int, ...] = GRAPH_ROWS  # model.graph_rows: cuda_graph's row buckets
    kernels: str = "auto"               # kernels: the draft-tree ops' implementation (torch | triton | auto)

    @classmethod
    def from_config(cls, cfg) -> ExecutionSpec:
        """The spec of a composed config (its ``model`` group and ``kernels``), every value checked: one
        ConfigError line for the first bad one, a device this machine lacks included (``resolve_device``)."""
        m = cfg.get("model") or {}
        backend = check_backend(m.get("backend", "auto"))
        quantize = check_quantize(m.get("quantize"))
        if quantize and backend not in ("auto", "native_cpu"):
            raise ConfigError(f"model.quantize={quantize} runs on the native_cpu backend, not model.backend={backend} "
                              "(use model.backend=auto or native_cpu)")
        device = str(m.get("device") or "auto")
        resolve_device(device)
        dtype = "auto" if m.get("dtype") is None else str(m.get("dtype"))
        if dtype not in DTYPES:
            raise ConfigError(f"model.dtype: unknown dtype {dtype!r} (use one of {', '.join(DTYPES)})")
        capacity = check_int("model.graph_capacity", m.get("graph_capacity", 2048), 16)
        rows = m.get("graph_rows")
        rows = check_graph_rows(list(rows) if rows is not None else GRAPH_ROWS, capacity)
        kernels = cfg.get("kernels") or "auto"
        if kernels not in IMPLS:
            raise ConfigError(f"kernels must be one of {', '.join(IMPLS)}, got {kernels!r}")
        return cls(backend=backend, quantize=quantize,
                   certified_head=check_flag("model.certified_head", m.get("certified_head", True)),
                   lean_forward=check_flag("model.lean_forward", m.get("lean_forward", True)),
                   device=device, dtype=dtype,
                   attn_implementation=str(m.get("attn_implementation") or "auto"), graph_capacity=capacity,
                   graph_rows=rows, kernels=str(kernels))

    def describe(self) -> str:
        """The choices that change what computes, as asked (the backend's ``describe()`` adds what it resolved)."""
        parts = [f"backend={self.backend}"]
        if self.quantize:
            parts.append(f"quantize={self.quantize}")
        if not self.certified_head:
            parts.append("certified_head=false")
        if not self.lean_forward:
            parts.append("lean_forward=false")
        if self.backend == "cuda_graph":
            parts.append(f"graph_capacity={self.graph_capacity}")
        return " ".join(parts)
