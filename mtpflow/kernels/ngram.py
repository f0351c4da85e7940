"""N-gram match over the token history for prompt lookup: the tokens that followed the latest earlier
occurrence of the longest matching suffix n-gram. The torch reference is PLD's original loop over n (fastest
on a CPU for histories of a few hundred tokens); the Triton kernel scores every end position at once (how
many tokens before it equal the context's suffix, capped at ``max_ngram``; the longest match wins, then the
latest) and is tested equal to the loop."""
from __future__ import annotations

import torch

from mtpflow.kernels.dispatch import resolve_impl


def ngram_continuation_reference(context: torch.Tensor, min_ngram: int, max_ngram: int, k: int) -> torch.Tensor:
    """[<= k] tokens that followed the latest earlier match of the longest matching suffix n-gram
    (n from max_ngram down to min_ngram); empty when nothing matches."""
    length = int(context.numel())
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = context[-n:]
        windows = context[:-1].unfold(0, n, 1)  # [length - n, n]; excludes the suffix itself
        hits = (windows == pattern).all(dim=1).nonzero().flatten()
        for start in reversed(hits.tolist()):  # most recent first
            follow = context[start + n : start + n + k]
            if follow.numel():
                return follow
    return context.new_zeros(0)


def _follow(context: torch.Tensor, key: int, min_ngram: int, k: int) -> torch.Tensor:
    """The continuation after the match the kernel's key names (length * len(context) + end; -1: none)."""
    length = int(context.numel())
    if key < 0 or key // length < min_ngram or k <= 0:
        return context.new_zeros(0)
    end = key % length
    return context[end + 1 : end + 1 + k]


def ngram_continuation(context: torch.Tensor, min_ngram: int, max_ngram: int, k: int,
                       impl: str | None = None) -> torch.Tensor:
    """Dispatcher: same result as ``ngram_continuation_reference``."""
    if resolve_impl(impl, context.device) == "torch":
        return ngram_continuation_reference(context, min_ngram, max_ngram, k)
    from mtpflow.kernels.ngram_triton import best_match_key_triton

    return _follow(context, best_match_key_triton(context, max_ngram), min_ngram, k)
