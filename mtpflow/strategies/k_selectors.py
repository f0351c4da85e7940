"""K selectors (stage ``select_k``): a fixed K, and an adaptive K that grows after a fully accepted step and
shrinks after a rejection, within bounds."""
from __future__ import annotations

from mtpflow.errors import ConfigError, check_k
from mtpflow.plugins import hookimpl
from mtpflow.types import DecodeState, StepRecord


class FixedK:
    """The same K every step (K = 0 is plain autoregressive decoding through the same loop)."""

    def __init__(self, k: int = 4):
        self.k = check_k("strategy.select_k.k", k)

    @hookimpl
    def select_k(self, state: DecodeState) -> int:
        return self.k


class AdaptiveK:
    """Raise K by ``increase`` after a step whose whole draft path was accepted, lower it by ``decrease``
    after a rejection; steps without a draft leave K alone. Bounded to [k_min, k_max]."""

    def __init__(self, k: int = 4, k_min: int = 1, k_max: int = 16, increase: int = 2, decrease: int = 1):
        self.k_min = check_k("strategy.select_k.k_min", k_min)
        self.k_max = check_k("strategy.select_k.k_max", k_max)
        if self.k_min > self.k_max:
            raise ConfigError(f"strategy.select_k.k_min ({k_min}) must not exceed k_max ({k_max})")
        self.k = min(max(check_k("strategy.select_k.k", k), self.k_min), self.k_max)
        self.increase = check_k("strategy.select_k.increase", increase)
        self.decrease = check_k("strategy.select_k.decrease", decrease)

    @hookimpl
    def select_k(self, state: DecodeState) -> int:
        return self.k

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        if record.draft.num_nodes == 0:
            return
        deepest = record.draft.max_depth()
        if record.decision.num_accepted >= deepest:
            self.k = min(self.k + self.increase, self.k_max)
        else:
            self.k = max(self.k - self.decrease, self.k_min)
