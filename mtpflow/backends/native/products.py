"""The native products (``mtpflow_linear`` in gemm.c) and the weight layouts they read, from torch tensors.

Why: on a CPU a verify forward of 1 + K rows is bound by reading the weights, yet MKL's and oneDNN's float32 paths
for 2 to 17 rows read them far slower than for one row, and these kernels beat them there (measured:
docs/bench/code-figures.md#native_linear-module-docstring). Up to ``panel_min_rows() - 1`` rows the row kernel
reads each weight row once for all input rows and prefetches the next rows while it computes; from
``panel_min_rows()`` rows (``PANEL_MIN_ROWS`` in gemm.c: 1 on AVX-512, 3 on AVX2) a second kernel runs over a copy
of the weight laid out in panels (``pack_panels``, built on first use by the caller); gemm.c says how.

Four kinds, one entry point: float32 weights (``linear``, rows or panels), int8 weights with float activations
(``linear_int8``: the self-draft's copy and the certified head), and the int8 model's W8A8 product (``gemm_w8a8``,
its numerics ``int8_reference.linear``'s). The pure-torch reference of each is in ``reference``. Callers check
``kernel.available()`` first.
"""
from __future__ import annotations

import ctypes

import torch

from mtpflow.backends.native import kernel
from mtpflow.backends.native.memory import streamed_empty

PANEL = 32  # output features per panel (gemm.c)
F32, PANELS, Q8, W8A8, Q8_PANELS = 0, 1, 2, 3, 4  # MTPFLOW_LINEAR_* in gemm.c
Q8_STEP = 64  # Q8_STEP in native.h: the int8 model's weight rows are padded with zeros to a multiple of it
Q8_PANEL = 32  # Q8_PANEL in native.h: output features per packed panel


def streamed(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in ``memory.streamed_empty``'s memory: a packed copy is what a step streams, so it
    goes on huge pages where the system grants them (one of 2 MB or more; a smaller one stays on plain pages)."""
    out = streamed_empty(t.numel(), t.dtype).view(t.shape)
    out.copy_(t)
    return out


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out x in) as ceil(out / PANEL) panels of in x PANEL (zero rows past ``out``): the panel
    kernel's layout, one more copy of the weight."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return streamed(padded.reshape(-1, PANEL, k).transpose(1, 2))


def pack_q8_panels(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [out, in] as the int8 panel kernel reads them (``pack_panels``' layout in int8: ceil(out / PANEL)
    panels of in x PANEL, zero rows past ``out``)."""
    n, k = q.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.int8)
    padded[:n] = q
    return streamed(padded.reshape(-1, PANEL, k).transpose(1, 2))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-feature int8 of a float weight (out x in): (q int8 [out, in], scale float32 [out])
    with ``weight ~= q * scale[:, None]``; a row of zeros gets scale 1 (q = 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale.contiguous()


def packed_q8_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """The shape ``pack_q8`` gives int8 weights [n, k]: [panels, kp / 4, Q8_PANEL, 4]."""
    kp = -(-k // Q8_STEP) * Q8_STEP
    return -(-n // Q8_PANEL), kp // 4, Q8_PANEL, 4


def pack_q8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] as the W8A8 kernel reads them (w8a8.c): zero columns up to kp (a multiple of Q8_STEP),
    zero rows up to a multiple of Q8_PANEL, each panel of Q8_PANEL rows laid out [kp / 4][Q8_PANEL][4] (each
    feature's four weights of a step side by side: one 32-bit lane per feature, a panel one sequential read).
    Returns [panels, kp / 4, Q8_PANEL, 4]."""
    n, k = q.shape
    panels, steps, width, four = packed_q8_shape(n, k)
    padded = torch.nn.functional.pad(q, (0, steps * four - k, 0, panels * width - n))
    return padded.view(panels, width, steps, four).transpose(1, 2).contiguous()


def unpack_q8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weights [n, k] that ``pack_q8`` packed."""
    return packed_q8_rows(packed, torch.arange(n))[:, :k]


def packed_q8_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` [r] of a ``pack_q8`` weight, with their zero padding: [r, kp]."""
    width = packed.shape[2]
    return packed[ids // width, :, ids % width, :].reshape(ids.numel(), -1)


def _run(lib: ctypes.CDLL | None, kind: int, x: torch.Tensor, n: int, bias: torch.Tensor | None = None,
         **members) -> torch.Tensor:
    """``mtpflow_linear`` of ``kind`` over float32 ``x`` [..., k]: the output [..., n] allocated in its final shape
    (called for every linear of a prefill's lean forward: nothing it can skip)."""
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    k = x.shape[-1]
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    code = kernel.call(kernel.library() if lib is None else lib, "linear", kind=kind, M=x.numel() // k, N=n, K=k,
                       threads=torch.get_num_threads(), x=x.data_ptr(), y=y.data_ptr(),
                       b=None if bias is None else bias.data_ptr(), **members)
    if code != 0:
        raise MemoryError("mtpflow_linear: out of memory")
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           panels: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors (x: ``(..., in)``); with ``panels``
    (``pack_panels(weight)``) and at least ``kernel.panel_min_rows()`` rows, the panel kernel."""
    if not weight.is_contiguous():
        weight = weight.contiguous()
    rows = x.numel() // x.shape[-1]
    if panels is not None and rows >= kernel.panel_min_rows(lib):
        return _run(lib, PANELS, x, weight.shape[0], bias, panels=panels.data_ptr())
    return _run(lib, F32, x, weight.shape[0], bias, w=weight.data_ptr())


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``F.linear(x, q * scale[:, None], bias)`` for float32 CPU ``x`` over int8 weights ``q`` [out, in] and
    float32 ``scale`` [out] (``quantize_int8``): the weight-only int8 kernel, every row count."""
    return _run(lib, Q8, x, q.shape[0], bias, q=q.data_ptr(), scale=scale.data_ptr())


def linear_int8_panels(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                       lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``linear_int8`` over the panel copy of the int8 weight (``pack_q8_panels``; ``scale`` [out] gives the output
    count): each weight read once for up to 12 rows (AVX-512), widened to floats once for all of them."""
    return _run(lib, Q8_PANELS, x, int(scale.numel()), bias, q=panels.data_ptr(), scale=scale.data_ptr())


def gemm_w8a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, wsum: torch.Tensor, k: int,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The int8 model's product (``int8_reference.linear``): float32 ``x`` [..., k], the packed int8 weight ``q``
    (``pack_q8``), float32 ``scale`` [N], int32 ``wsum`` [N] (the weight rows' sums)."""
    return _run(lib, W8A8, x, int(scale.numel()), None, kp=q.shape[1] * q.shape[3], q=q.data_ptr(),
                scale=scale.data_ptr(), wsum=wsum.data_ptr())
