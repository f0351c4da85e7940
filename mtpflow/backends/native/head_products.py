"""A draft head's linears through the native products (``Backend.head_product``): Medusa's residual blocks, the
EAGLE layers' projections and the draft-vocabulary LM head.

A drafting step multiplies one to a few rows by weights of a few MB, which is what the native row and panel kernels
are for (they read each weight once for all rows). On the int8 model the draft may read its weights in int8 too: a
draft is only ever checked by the target, so its precision trades acceptance for speed and never the output.
Two precisions:
- float32: the row kernel (``products.linear``), the panel kernel from ``kernel.panel_min_rows()`` rows (over a
  panel copy made here once);
- int8: the int8 model's product (``products.gemm_w8a8``: per-output int8 weights, each input row quantized to int8,
  integer dot products), a quarter of the bytes; a bias is added in float32 after it.
"""
from __future__ import annotations

import ctypes

import torch

from mtpflow.backends.native import kernel, products


class HeadProduct:
    """``x [..., in] -> x @ weight.T + bias [..., out]`` over this object's own copy of ``weight`` (float32 and its
    panels, or int8 packed for the W8A8 product). Callable; the copy never follows later changes to ``weight``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, int8: bool, lib: ctypes.CDLL):
        w = weight.detach().float()
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.lib, self.int8 = lib, bool(int8)
        self.min_panel_rows = kernel.panel_min_rows(lib)
        if self.int8:
            q, self.scale = products.quantize_int8(w)
            self.q = products.streamed(products.pack_q8(q))  # what each draft step streams
            self.wsum = q.sum(dim=1, dtype=torch.int32).contiguous()
        else:
            self.weight = w.contiguous()
            self.panels = products.pack_panels(self.weight)

    @property
    def nbytes(self) -> int:
        """The bytes one product reads of the weight (the panel copy counts once: a product reads one layout)."""
        if self.int8:
            return int(self.q.numel() + self.scale.numel() * 4 + self.wsum.numel() * 4)
        return int(self.weight.numel() * 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.int8:
            y = products.gemm_w8a8(x, self.q, self.scale, self.wsum, self.in_features, self.lib)
            return y if self.bias is None else y.add_(self.bias)
        rows = x.numel() // self.in_features
        panels = self.panels if rows >= self.min_panel_rows else None
        return products.linear(x, self.weight, self.bias, panels, self.lib)
