"""Run-level plugins chosen by the top-level config (trace recording, metrics), added to every run of the
CLI, the benchmark and the playground."""
from __future__ import annotations

from omegaconf import DictConfig


def default_run_plugins(cfg: DictConfig) -> tuple:
    """Factories ``f(pipeline) -> plugin`` for the run plugins the config enables."""
    return ()
