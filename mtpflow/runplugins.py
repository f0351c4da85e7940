"""Run-level plugins chosen by the top-level config (trace recording, metrics), added to every run of the
CLI, the benchmark and the playground."""
from __future__ import annotations

from omegaconf import DictConfig


def default_run_plugins(cfg: DictConfig) -> tuple:
    """Factories ``f(pipeline) -> plugin`` for the run plugins the config enables."""
    factories = []
    trace = cfg.get("trace")
    if trace is not None and trace.get("enabled", False):
        # Opening the store here (before the model loads) turns a corrupt file or an unwritable folder
        # into one UserError line up front; trace.sample and trace.retention apply to every run plugin user.
        from mtpflow.traces.recorder import recorder_from_config

        factories.append(recorder_from_config(trace))
    return tuple(factories)
