"""Length-scheduled K (stage ``select_k``): the request's length in tokens sets K once per run, shorter requests
drafting longer (< 128 tokens -> 4, 128..512 -> 3, > 512 -> 2 by default). Long prompts make every verify
forward dearer (attention over a longer cache) while prompt-lookup drafts from them are no more likely to be
accepted deep, so K shrinks with length."""
from __future__ import annotations

from typing import Any

from mtpflow.errors import ConfigError, check_k
from mtpflow.plugins import hookimpl
from mtpflow.types import DecodeState

MEASURES = ("request", "input")


class LengthScheduleK:
    """K by prompt length: ``short_k`` below ``short_below`` tokens, ``long_k`` above ``long_above``,
    ``medium_k`` in between (both bounds inclusive).

    ``measure``: ``request`` counts the tokens of the user's text alone (the schedule does not move when the
    chat template or system prompt changes); ``input`` counts every prompt token fed to the model.
    ``k`` (the ``k=`` shortcut) fixes K whatever the length.
    """

    def __init__(self, short_below: int = 128, long_above: int = 512, short_k: int = 4, medium_k: int = 3,
                 long_k: int = 2, measure: str = "request", k: int | None = None):
        for name, value in (("short_below", short_below), ("long_above", long_above)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"strategy.select_k.{name} must be a positive integer, got {value!r}")
        if short_below > long_above:
            raise ConfigError(f"strategy.select_k.short_below ({short_below}) must not exceed "
                              f"long_above ({long_above})")
        if measure not in MEASURES:
            raise ConfigError(f"strategy.select_k.measure must be one of {', '.join(MEASURES)}, got {measure!r}")
        self.short_below, self.long_above, self.measure = short_below, long_above, measure
        self.short_k = check_k("strategy.select_k.short_k", short_k)
        self.medium_k = check_k("strategy.select_k.medium_k", medium_k)
        self.long_k = check_k("strategy.select_k.long_k", long_k)
        self.fixed_k = None if k is None else check_k("strategy.select_k.k", k)
        self.k: int | None = None  # set in on_run_start; select_k falls back to the state's prompt length

    def k_for_length(self, length: int) -> int:
        if self.fixed_k is not None:
            return self.fixed_k
        if length < self.short_below:
            return self.short_k
        if length > self.long_above:
            return self.long_k
        return self.medium_k

    def prompt_length(self, context) -> int:
        if self.measure == "request" and context.tokenizer is not None:
            from mtpflow.strategies.domain import request_text

            text = request_text(context.prompt)
            return len(context.tokenizer(text, add_special_tokens=False)["input_ids"])
        return int(context.prompt_tokens.numel())

    @hookimpl
    def on_run_start(self, context) -> dict[str, Any]:
        length = self.prompt_length(context)
        self.k = self.k_for_length(length)
        return {"prompt_length_tokens": length, "length_k": self.k}

    @hookimpl
    def select_k(self, state: DecodeState) -> int:
        return self.k if self.k is not None else self.k_for_length(state.prompt_len)
