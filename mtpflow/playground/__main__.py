"""``python -m mtpflow.playground [--host H] [--port P] [overrides ...]``: load the model once, serve the page.

Positional ``key=value`` arguments are the same Hydra overrides as the CLI's (``model.name=...``,
``trace.db=...``, ``trace=off``); they set what every run on the page starts from. User mistakes exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mtpflow.playground", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=os.environ.get("MTPFLOW_PLAYGROUND_HOST", "127.0.0.1"),
                   help="interface to listen on (0.0.0.0 for every interface; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(os.environ.get("MTPFLOW_PLAYGROUND_PORT", "7860")),
                   help="port (default 7860; 0 picks a free one)")
    p.add_argument("--max-tokens", type=int, default=1024, help="the largest max-new-tokens a visitor may ask for")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up decode at start")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.name=ID trace.db=PATH trace=off")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mtpflow.errors import UserError

    try:
        if args.max_tokens < 1:
            raise UserError(f"--max-tokens must be positive, got {args.max_tokens}")
        bad = [o for o in args.overrides if "=" not in o]
        if bad:
            raise UserError(f"overrides are key=value, got {bad[0]!r}")
        from mtpflow.playground.app import build_blocks
        from mtpflow.playground.runner import PlaygroundRunner
        from mtpflow.playground.server import create_server_app, free_port

        runner = PlaygroundRunner(tuple(args.overrides), max_tokens_cap=args.max_tokens)
        if not args.no_warmup:
            print(f"mtpflow playground: warm-up decode took {runner.warm_up():.2f} s", flush=True)
        app = create_server_app(build_blocks(runner), runner.trace_store())
    except UserError as exc:
        print(f"mtpflow playground: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    port = args.port or free_port(args.host)
    print(f"mtpflow playground: serving {runner.loaded.model_id} on http://{args.host}:{port}/ "
          f"(metrics on /metrics)", flush=True)
    uvicorn.run(app, host=args.host, port=port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
