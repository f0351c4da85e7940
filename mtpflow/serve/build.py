"""Building the server from its command line: the config (traces on ``trace=serve`` unless told otherwise), the
engine and the FastAPI app; shared by ``python -m mtpflow.serve`` and the Ray Serve replicas."""
from __future__ import annotations

import argparse
import os

API_KEY_ENV = "MTPFLOW_API_KEY"


def serving_overrides(overrides: list[str]) -> list[str]:
    """The server records with ``trace=serve`` (sampled token events, capped database) unless told otherwise."""
    chooses_trace = any(o.split("=", 1)[0].lstrip("+~") == "trace" for o in overrides)
    return list(overrides) if chooses_trace else ["trace=serve", *overrides]


def serving_run_plugins(cfg) -> tuple:
    """``default_run_plugins`` with the trace recorder rebuilt from the whole ``trace`` node (sampling and
    retention) on the store it opened."""
    from mtpflow.plugins.manager import default_run_plugins
    from mtpflow.traces.recorder import recorder_from_config

    out = []
    for factory in default_run_plugins(cfg):
        if hasattr(factory, "store") and getattr(factory, "retention", None) is None:  # built without them
            factory = recorder_from_config(cfg.trace, store=factory.store)
        out.append(factory)
    return tuple(out)


def build_app(args: argparse.Namespace):
    """Compose the config, load the engine, and return (app, cfg)."""
    from mtpflow.config import compose, validate
    from mtpflow.engine import Engine
    from mtpflow.host import check_named_profile
    from mtpflow.serve.app import create_app

    cfg = compose(serving_overrides(args.overrides))
    validate(cfg)
    check_named_profile(cfg.get("profile"))  # a damaged or foreign tuning profile: one line and exit 2, at start
    plugins = serving_run_plugins(cfg)
    recorder = next((f for f in plugins if hasattr(f, "store")), None)
    engine = Engine(cfg, run_plugins=plugins)
    name = args.served_model_name or str(cfg.model.name).rstrip("/\\")
    app = create_app(engine, served_model=name, default_strategy=str(cfg.strategy.get("name", "?")),
                     api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                     store=getattr(recorder, "store", None), retention=getattr(recorder, "retention", None))
    return app, cfg
