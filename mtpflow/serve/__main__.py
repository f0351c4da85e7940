"""``python -m mtpflow.serve [--host H] [--port P] [--api-key KEY] [key=value ...]``: load the model once and serve
the OpenAI API on the batching engine (see docs/server.md). Hydra overrides as for ``python -m mtpflow``:
``strategy=`` (the default strategy), ``model.name=``, ``max_batch_size=``, ``trace.sample=`` ...

SIGTERM (or Ctrl-C) drains: new requests get 503, running and waiting ones finish (up to ``--drain-timeout``
seconds, then they are cancelled and recorded ``interrupted``), and the trace database is checkpointed.

``--ray --replicas N`` (or ``--min-replicas A --max-replicas B``) serves N engine replicas behind Ray Serve
instead (``mtpflow.serve.ray_app``).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from mtpflow.serve.build import API_KEY_ENV, build_app


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mtpflow.serve",
                                description="OpenAI-compatible server on the mtpflow engine.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}; prefer the variable, "
                        "a command line is visible to other users)")
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: model.name)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for open requests before cancelling them (default 30)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ray = p.add_argument_group("many replicas on Ray Serve (pip install 'mtpflow[ray]'; docs/server.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve engine replicas behind Ray Serve (a local Ray instance unless --ray-address)")
    ray.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. 'auto') instead of a local one")
    ray.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default 1)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale: the fewest replicas")
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscale: the most replicas")
    ray.add_argument("--target-ongoing-requests", type=float, default=None,
                     help="autoscale: requests in flight (running + queued) per replica to aim for "
                          "(default: max_batch_size)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs (and torch threads) per replica")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="Hydra overrides, e.g. strategy=pld")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    if args.drain_timeout < 0:
        p.error("--drain-timeout must be >= 0")
    ray_only = [f for f in ("ray_address", "replicas", "min_replicas", "max_replicas", "target_ongoing_requests")
                if getattr(args, f) is not None]
    if ray_only and not args.ray:
        p.error(f"--{ray_only[0].replace('_', '-')} needs --ray")
    return args


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, but the first SIGTERM/SIGINT also flags the app as draining (503 for new requests),
        and the process exits 0 after a clean drain instead of re-raising the signal."""

        def __init__(self, config, state):
            super().__init__(config)
            self.mtpflow_state = state

        def handle_exit(self, sig, frame):
            self.mtpflow_state.draining = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting
            else:
                self.should_exit = True

    return DrainingServer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from mtpflow.errors import UserError

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    if args.ray:
        try:
            from mtpflow.serve.ray_app import run_on_ray
        except ImportError as exc:
            print(f"mtpflow.serve: error: --ray needs Ray Serve ({exc}); pip install 'mtpflow[ray]'", file=sys.stderr)
            return 2
        return run_on_ray(args)
    try:
        app, cfg = build_app(args)
    except UserError as exc:
        print(f"mtpflow.serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    import uvicorn

    state = app.state.mtpflow
    retention = state.retention
    print(f"mtpflow.serve: {state.served_model} on {state.engine.__class__.__name__} "
          f"(default strategy {state.default_strategy}; max_batch_size {cfg.get('max_batch_size', '?')}); "
          f"traces: {'off' if state.store is None else state.store.path} "
          f"(sample {cfg.trace.get('sample', 1.0) if state.store is not None else '-'}, retention "
          f"{retention.describe() if retention is not None else 'none'}); "
          f"API key {'required' if state.api_key else 'not required'}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout, lifespan="on")
    server = _server_class()(config, state)
    try:
        server.run()
    finally:
        if not state.shut_down:  # uvicorn never started (the port is taken): stop the engine's thread
            state.engine.shutdown(drain=False)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
