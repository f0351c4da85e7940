"""The LM head of a greedy verify forward at a quarter of its weight bytes, with the target's argmax kept exact.

A greedy gate reads one thing from each verify row: the target's argmax. At batch 1 on a CPU the LM head reads
its whole float32 weight every step (the default model's: 113 MB, a fifth of a step's weight bytes), for 1 to 17
rows. Here the head runs through the native int8 panel kernel (``products.linear_int8_panels``: a quarter of the
bytes, each read once for all the rows) and every logit comes with a rigorous error bound: for weight row
``w_j = q_j * s_j + r_j``,

    |x . w_j - approx_j| <= ||x||_2 * ||r_j||_2  +  ROUNDING * ||x||_1 * max|w_j|

(Cauchy-Schwarz on the quantization residual, plus float32 accumulation over the hidden size with a wide margin).
A token can be the exact argmax only if its upper bound reaches the largest lower bound; those candidates (two
or three per row on the default model) get their exact float32 logits from the float weight, written over the
approximation. So the argmax of every row is the float32 model's, ties included (first index); the entries near
the top are exact and the rest are within the bound (the traces' probabilities of far-off tokens, token
recycling's lower candidates). Sequences that read the whole distribution (sampling, typical or composite
gates, the re-scorer) get the float32 head: ``Target.argmax_only``; the ``native_cpu`` backend owns the head
(``NativeCPUBackend.head_logits``).

Memory: the int8 copy of the head weight plus three floats per token (28.9 MB for the default model), built on
first use and rebuilt when the weight changes. Above ``MAX_ROWS`` rows the int8 kernel is no faster than the
float32 head (compute, not bytes, bounds it) and the float32 head runs.
"""
from __future__ import annotations

import torch

from mtpflow.backends.native import kernel, products

# float32 accumulation over k terms errs by at most about k * 2^-24 of the sum of |terms|; 2^-12 covers a hidden
# size of 4,096 with margin (the bound also absorbs the rounding of the bound's own arithmetic)
ROUNDING = 2.0 ** -12
# widest verify (rows) that takes the int8 head: its lead over the float32 head shrinks as rows grow (compute, not
# bytes, comes to bound it) and is gone by 33 rows (measured: docs/bench/code-figures.md#certified_head-max_rows)
MAX_ROWS = 24


class CertifiedHead:
    """The int8 head of one float32 weight ``[vocab, hidden]`` with its per-token error terms."""

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach()
        self.weight = weight if weight.is_contiguous() else weight.contiguous()
        self.key = (weight.data_ptr(), weight._version)
        q, self.scale = products.quantize_int8(self.weight)  # [vocab, hidden] int8, [vocab]
        residual = self.weight - q.float() * self.scale[:, None]
        self.panels = products.pack_q8_panels(q)  # the int8 panel kernel's layout: read once for up to 12 rows
        self.residual_norm = residual.norm(dim=1)  # [vocab] ||r_j||_2
        self.abs_max = self.weight.abs().amax(dim=1)  # [vocab] max |w_j|
        self.coarse_residual = float(self.residual_norm.max())
        self.coarse_abs_max = float(self.abs_max.max())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.panels, self.scale, self.residual_norm, self.abs_max))

    def logits(self, x: torch.Tensor, cap: float = 0.0) -> torch.Tensor:
        """[rows, vocab] float32 logits of ``x`` [rows, hidden] (soft-capped by ``cap``, ``softcap``): exact for
        every token that could be its row's argmax, within the bound elsewhere. The soft-cap is monotone but may
        round two logits to one value: a token is kept as a candidate while its capped upper bound reaches the
        largest capped lower bound, so a tie the cap makes is decided by the exact values, as HF's argmax
        decides it (the first index)."""
        x = x.reshape(-1, x.shape[-1]).contiguous()
        approx = products.linear_int8_panels(x, self.panels, self.scale)
        l2 = x.norm(dim=1)  # [rows]
        l1 = x.abs().sum(dim=1)
        # one bound for every token of a row first (a cheap compare over the vocabulary): a token under the
        # row's best approximation by more than twice it cannot be the argmax
        coarse = l2 * self.coarse_residual + ROUNDING * l1 * self.coarse_abs_max
        if cap:
            near = (softcap(approx + coarse[:, None], cap)
                    >= softcap(approx.amax(dim=1) - coarse, cap)[:, None]).nonzero()
        else:
            near = (approx >= (approx.amax(dim=1) - 2 * coarse)[:, None]).nonzero()
        rows, cols = near[:, 0], near[:, 1]
        # then each remaining token's own bound
        bound = l2[rows] * self.residual_norm[cols] + ROUNDING * l1[rows] * self.abs_max[cols]
        value = approx[rows, cols]
        lower = torch.full((x.shape[0],), -torch.inf).scatter_reduce(0, rows, value - bound, "amax")
        keep = softcap(value + bound, cap) >= softcap(lower, cap)[rows]
        rows, cols = rows[keep], cols[keep]
        approx[rows, cols] = (x[rows] * self.weight[cols]).sum(dim=-1)
        return softcap(approx, cap)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (HF's final logit soft-cap, its operations in its order); ``cap`` 0: the
    logits as they are."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


def applies(head: torch.nn.Module, rows: int) -> bool:
    """True where ``rows`` rows of ``head`` may take the certified int8 path: a float32 CPU linear without bias,
    the native kernels built, at most ``MAX_ROWS`` rows."""
    weight = getattr(head, "weight", None)
    return (rows <= MAX_ROWS and isinstance(head, torch.nn.Linear) and head.bias is None
            and weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and kernel.available())
