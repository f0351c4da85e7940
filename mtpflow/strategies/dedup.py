"""n-gram dedup (stage ``dedup``): refuse an accepted draft token that would complete a run of repeated
n-grams (the same token N times, the same bigram M times in a row, ...). The loop cuts the accepted path
there and the re-scorer puts the target's own token at the cut, so with a verifying gate the output is
unchanged and with a lossy gate a degenerate repetition loop can no longer be accepted wholesale."""
from __future__ import annotations

import torch

from mtpflow.errors import ConfigError, check_int
from mtpflow.plugins import hookimpl
from mtpflow.types import DecodeState, Decision, Draft


def repeated_run_end(tokens: list[int], min_repeats: dict[int, int]) -> bool:
    """True when ``tokens`` ends with some n-gram repeated at least ``min_repeats[n]`` times back to back."""
    for n, repeats in min_repeats.items():
        span = n * repeats
        if len(tokens) < span:
            continue
        tail = tokens[-span:]
        if all(tail[i] == tail[i - n] for i in range(n, span)):
            return True
    return False


class NgramDedup:
    """Keep-mask over the accepted path: False from the first token that completes a repeated-n-gram run.

    ``min_repeats`` lists, for n = 1, 2, ..., how many back-to-back copies of an n-gram count as a run
    (default ``[4, 3]``: a token four times in a row, or a bigram three times in a row). Only the draft
    token that completes (or extends) the run is refused; the earlier copies may be committed text.
    """

    def __init__(self, min_repeats: list[int] | int = (4, 3), lookback: int = 64):
        repeats = [min_repeats] if isinstance(min_repeats, (int, float, str)) else list(min_repeats)
        if not repeats:
            raise ConfigError("strategy.dedup.min_repeats needs one count per n-gram size, e.g. [4, 3]")
        # one count per n-gram size (1-grams first)
        self.min_repeats = {n: check_int("strategy.dedup.min_repeats", r, 2) for n, r in enumerate(repeats, start=1)}
        need = max(n * r for n, r in self.min_repeats.items())  # the longest run
        self.lookback = check_int("strategy.dedup.lookback", lookback, need)  # a run starts at most this far back

    @hookimpl
    def dedup(self, state: DecodeState, draft: Draft, decision: Decision) -> torch.Tensor:
        context = state.tokens[-self.lookback:].tolist()
        keep = torch.ones(decision.num_accepted, dtype=torch.bool)
        for i, node in enumerate(decision.accepted.tolist()):
            context.append(int(draft.tokens[node]))
            if repeated_run_end(context, self.min_repeats):
                keep[i:] = False
                break
        return keep
