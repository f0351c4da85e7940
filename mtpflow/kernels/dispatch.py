"""Which implementation a draft-tree op runs (its "impl"): the Triton kernel or its pure-torch reference. The
config key ``kernels`` names it for users; this is not a backend (``mtpflow.backends`` decides how the target
computes).

``auto`` picks Triton when it is importable and the tensors live on CUDA, the torch reference otherwise;
``torch`` and ``triton`` force one (``triton`` runs CPU tensors through the interpreter when
``TRITON_INTERPRET=1``, slow and meant for tests; on a CUDA machine host-resident data stays on the reference).
A run scopes its choice with ``use_impl`` (a context variable, so two pipelines in two threads do not see each
other's choice); ``set_default_impl`` is the one setter of the process-wide default.
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

IMPLS = ("auto", "torch", "triton")

_scoped_impl: contextvars.ContextVar[str | None] = contextvars.ContextVar("mtpflow_kernels_impl", default=None)
_process_default = {"impl": "auto"}  # changed only through set_default_impl


def check_impl(name) -> str:
    """The implementation's name, or ConfigError for anything outside IMPLS."""
    if name not in IMPLS:
        raise ConfigError(f"kernels (the draft-tree ops' implementation) must be one of {', '.join(IMPLS)}, "
                          f"got {name!r}")
    return str(name)


def check_impl_usable(name) -> str:
    """``check_impl`` plus, for ``triton``, that a kernel could actually launch here (config validation)."""
    name = check_impl(name)
    if name == "triton":
        resolve_impl("triton", "cuda" if torch.cuda.is_available() else "cpu")
    return name


def set_default_impl(name: str) -> None:
    """Set the process-wide default implementation (used when no run scoped one with ``use_impl``)."""
    _process_default["impl"] = check_impl(name)


@contextlib.contextmanager
def use_impl(name: str | None) -> Iterator[None]:
    """Run the body with ``name`` as the implementation of the kernel calls made from this thread / context."""
    token = _scoped_impl.set(None if name is None else check_impl(name))
    try:
        yield
    finally:
        _scoped_impl.reset(token)


def requested_impl() -> str:
    return _scoped_impl.get() or _process_default["impl"]


@functools.lru_cache(maxsize=1)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def resolve_impl(impl: str | None = None, device: torch.device | str | None = None) -> str:
    """``torch`` or ``triton`` for a call whose tensors live on ``device``.

    An explicit ``impl`` wins over the scoped one, which wins over the process default.
    """
    name = check_impl(impl) if impl is not None else requested_impl()
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
