"""N-gram match over the token history for prompt lookup: the tokens that followed the latest earlier
occurrence of the longest matching suffix n-gram, and that n. The torch reference is PLD's original loop over n;
on a CPU the match runs as a byte search from the end (``ngram_match_bytes``); the Triton kernel scores every end
position at once (how many tokens before it equal the context's suffix, capped at ``max_ngram``; the longest match
wins, then the latest). Both are tested equal to the loop."""
from __future__ import annotations

import torch

from mtpflow.kernels.dispatch import resolve_impl


def ngram_match_reference(context: torch.Tensor, min_ngram: int, max_ngram: int,
                          k: int) -> tuple[int | None, torch.Tensor]:
    """(n, [<= k] tokens that followed the latest earlier match of the longest matching suffix n-gram), n from
    max_ngram down to min_ngram; (None, empty) when nothing matches."""
    length = int(context.numel())
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = context[-n:]
        windows = context[:-1].unfold(0, n, 1)  # [length - n, n]; excludes the suffix itself
        hits = (windows == pattern).all(dim=1).nonzero().flatten()
        for start in reversed(hits.tolist()):  # most recent first
            follow = context[start + n : start + n + k]
            if follow.numel():
                return n, follow
    return None, context.new_zeros(0)


def ngram_continuation_reference(context: torch.Tensor, min_ngram: int, max_ngram: int, k: int) -> torch.Tensor:
    """[<= k] tokens that followed the latest earlier match of the longest matching suffix n-gram
    (n from max_ngram down to min_ngram); empty when nothing matches."""
    return ngram_match_reference(context, min_ngram, max_ngram, k)[1]


def ngram_match_bytes(context: torch.Tensor, min_ngram: int, max_ngram: int,
                      k: int) -> tuple[int | None, torch.Tensor]:
    """``ngram_match_reference``'s result for a CPU ``context``: each n-gram is searched as a substring of the tokens' bytes, from the
    end (``bytes.rfind``, C speed; a hit that does not start on a token's first byte is skipped). The loop per n
    over a few hundred tokens cost several torch operations each; this is one copy of the tokens a call."""
    length = int(context.numel())
    width = context.element_size()
    data = context.contiguous().numpy().tobytes()
    limit = (length - 1) * width  # a match ends before the last token (the suffix itself is no match)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = data[(length - n) * width:]
        end = limit
        while (start := data.rfind(pattern, 0, end)) >= 0:
            if start % width == 0:  # the latest match of these n tokens
                first = start // width + n
                follow = context[first:first + k]
                if follow.numel():
                    return n, follow
                break  # k <= 0: no continuation at any match of this n
            end = start + len(pattern) - 1  # a hit across token boundaries: look further left
    return None, context.new_zeros(0)


def _follow(context: torch.Tensor, key: int, min_ngram: int, k: int) -> tuple[int | None, torch.Tensor]:
    """(n, the continuation) after the match the kernel's key names (length * len(context) + end; -1: none)."""
    length = int(context.numel())
    if key < 0 or key // length < min_ngram or k <= 0:
        return None, context.new_zeros(0)
    end = key % length
    return key // length, context[end + 1 : end + 1 + k]


def ngram_match(context: torch.Tensor, min_ngram: int, max_ngram: int, k: int,
                impl: str | None = None) -> tuple[int | None, torch.Tensor]:
    """Dispatcher: ``ngram_match_reference``'s (n, continuation): the Triton kernel, or on the CPU the byte search
    (``ngram_match_bytes``), else the reference."""
    if resolve_impl(impl, context.device) == "torch":
        if context.device.type == "cpu":
            return ngram_match_bytes(context, min_ngram, max_ngram, k)
        return ngram_match_reference(context, min_ngram, max_ngram, k)
    from mtpflow.kernels.ngram_triton import best_match_key_triton

    return _follow(context, best_match_key_triton(context, max_ngram), min_ngram, k)


def ngram_continuation(context: torch.Tensor, min_ngram: int, max_ngram: int, k: int,
                       impl: str | None = None) -> torch.Tensor:
    """``ngram_match``'s continuation only (same result as ``ngram_continuation_reference``)."""
    return ngram_match(context, min_ngram, max_ngram, k, impl)[1]
