"""Which implementation a kernel call runs: the Triton kernel or its pure-torch reference.

``auto`` picks Triton when it is importable and the tensors live on CUDA, the torch reference otherwise;
``torch`` and ``triton`` force one (``triton`` runs CPU tensors through the interpreter when
``TRITON_INTERPRET=1``, slow and meant for tests; on a CUDA machine host-resident data stays on the reference). A run scopes its choice with ``use_backend`` (a context variable, so two pipelines in two threads do not
see each other's choice); ``set_default_backend`` is the one setter of the process-wide default.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from typing import Iterator

import torch

from mtpflow.errors import ConfigError

BACKENDS = ("auto", "torch", "triton")

_scoped_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("mtpflow_kernel_backend", default=None)
_process_default = {"backend": "auto"}  # changed only through set_default_backend


def check_backend(name) -> str:
    """The backend name, or ConfigError for anything outside BACKENDS."""
    if name not in BACKENDS:
        raise ConfigError(f"kernels must be one of {', '.join(BACKENDS)}, got {name!r}")
    return str(name)


def check_backend_usable(name) -> str:
    """``check_backend`` plus, for ``triton``, that a kernel could actually launch here (config validation)."""
    name = check_backend(name)
    if name == "triton":
        resolve_backend("triton", "cuda" if torch.cuda.is_available() else "cpu")
    return name


def set_default_backend(name: str) -> None:
    """Set the process-wide default backend (used when no run scoped one with ``use_backend``)."""
    _process_default["backend"] = check_backend(name)


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Run the body with ``name`` as the backend for kernel calls made from this thread / context."""
    token = _scoped_backend.set(None if name is None else check_backend(name))
    try:
        yield
    finally:
        _scoped_backend.reset(token)


def requested_backend() -> str:
    return _scoped_backend.get() or _process_default["backend"]


@functools.lru_cache(maxsize=1)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def resolve_backend(backend: str | None = None, device: torch.device | str | None = None) -> str:
    """``torch`` or ``triton`` for a call whose tensors live on ``device``.

    An explicit ``backend`` wins over the scoped one, which wins over the process default.
    """
    name = check_backend(backend) if backend is not None else requested_backend()
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if name == "auto":
        return "triton" if on_cuda and triton_installed() else "torch"
    if name == "triton":
        if not triton_installed():
            raise ConfigError("kernels=triton but the triton package is not installed")
        if on_cuda or interpreter_enabled():
            return "triton"
        if torch.cuda.is_available():
            return "torch"  # host-resident data (e.g. the token history): no device to launch a kernel on
        raise ConfigError("kernels=triton on CPU needs TRITON_INTERPRET=1 set before triton is imported "
                          "(slow; meant for tests), or use kernels=auto")
    return name
