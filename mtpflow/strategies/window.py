"""The KV window with attention sinks (stage ``window``, StreamingLLM, Xiao et al. 2023): keep the first few
cache entries (the sinks every later token attends to) plus the most recent ones, so generation can run
past the model's context length. ``Target.keep`` re-rotates the kept RoPE keys so positions stay inside the
cache; the proposer-side window is the strategy key ``context_window`` (``DecodeState.proposer_context``)."""
from __future__ import annotations

import torch

from mtpflow.errors import ConfigError, UserError, check_int
from mtpflow.plugins import hookimpl
from mtpflow.types import DecodeState


class AttentionSinkWindow:
    """Evict the middle of the KV cache when fewer than ``room`` entries are left free.

    ``cache_size`` (default: the model's ``max_position_embeddings``) bounds the entries kept. Before a
    verify forward would not fit ``room`` more entries (the root plus up to ``room - 1`` draft tokens; the
    loop caps K by what is left), the window keeps the first ``sink_tokens`` entries and the newest ones so
    that ``headroom`` entries are free again. Evicting ``headroom`` at a time pays the re-rotation pass over
    the cache once per ``headroom - room`` tokens rather than every step.
    """

    def __init__(self, sink_tokens: int = 4, cache_size: int | None = None, room: int = 16, headroom: int = 64):
        self.sink_tokens = check_int("strategy.window.sink_tokens", sink_tokens, 0)
        self.cache_size = None if cache_size is None else check_int("strategy.window.cache_size", cache_size, 1)
        self.room = check_int("strategy.window.room", room, 2)
        self.headroom = check_int("strategy.window.headroom", headroom, self.room)
        if self.cache_size is not None:
            self._check(self.cache_size)
        self.evictions = 0

    def _check(self, cache_size: int) -> None:
        if cache_size - self.headroom - self.sink_tokens < 1:
            raise ConfigError(f"strategy.window: cache_size ({cache_size}) must exceed headroom ({self.headroom}) "
                              f"+ sink_tokens ({self.sink_tokens})")

    @hookimpl
    def on_run_start(self, context) -> None:
        if self.cache_size is None:
            limit = getattr(getattr(context.model, "config", None), "max_position_embeddings", None)
            if not limit:
                raise UserError("strategy.window.cache_size is needed: the model config has no max_position_embeddings")
            self._check(int(limit))
            self.cache_size = int(limit)

    @hookimpl
    def window(self, state: DecodeState, cache_len: int) -> torch.Tensor | None:
        if cache_len + self.room <= self.cache_size:
            return None
        recent = self.cache_size - self.headroom - self.sink_tokens
        self.evictions += 1
        return torch.cat([torch.arange(self.sink_tokens), torch.arange(cache_len - recent, cache_len)])

    @hookimpl
    def run_stats(self) -> dict:
        return {"window_evictions": self.evictions}
