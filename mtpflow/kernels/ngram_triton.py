"""Triton kernel for the prompt-lookup n-gram match: each program scores a block of end positions against
the context's suffix and folds its best (length, recency) key into one int64 with an atomic max."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def ngram_match_kernel(context_ptr, key_ptr, length, max_ngram, BLOCK: tl.constexpr):
    ends = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = ends < length - 1  # the suffix itself (end = length - 1) is excluded
    still = valid
    match_len = tl.zeros((BLOCK,), dtype=tl.int64)
    for i in range(0, max_ngram):
        pos = ends - i
        ok = still & (pos >= 0)
        mine = tl.load(context_ptr + pos, mask=ok, other=-1)
        suffix = tl.load(context_ptr + (length - 1 - i))
        still = ok & (mine == suffix)
        match_len += still.to(tl.int64)
    keys = tl.where(match_len > 0, match_len * length + ends.to(tl.int64), -1)
    tl.atomic_max(key_ptr, tl.max(keys, axis=0))


def best_match_key_triton(context: torch.Tensor, max_ngram: int) -> int:
    """max over end positions e < length - 1 of min(match length, max_ngram) * length + e, or -1 when nothing
    matches: the match length at e counts i = 0, 1, ... while context[e - i] == context[length - 1 - i], so
    the key orders by length first and by recency second."""
    length = int(context.numel())
    if length < 2 or max_ngram < 1:
        return -1
    key = torch.full((1,), -1, dtype=torch.long, device=context.device)
    block = 256
    ngram_match_kernel[(triton.cdiv(length - 1, block),)](context.contiguous(), key, length,
                                                          min(max_ngram, length - 1), BLOCK=block)
    return int(key.item())
