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
        # into one UserError line up front.
        from mtpflow.traces.recorder import recorder_factory
        from mtpflow.traces.store import TraceStore

        store = TraceStore(trace.get("db"), busy_timeout_seconds=float(trace.get("busy_timeout_seconds", 30.0)))
        factories.append(recorder_factory(store, flush_seconds=float(trace.get("flush_seconds", 1.0))))
    return tuple(factories)
