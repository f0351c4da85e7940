"""``python -m mtpflow.playground [--host H] [--port P] [--users FILE] [--api-key-login] [overrides ...]``: load the
model once, serve the page (behind a login page with --users or --api-key-login).

Positional ``key=value`` arguments are the same Hydra overrides as the CLI's (``model.name=...``,
``trace.db=...``, ``trace=off``); they set what every run on the page starts from. User mistakes exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys


USERS_ENV = "MTPFLOW_PLAYGROUND_USERS"
USER_ENV, PASSWORD_ENV = "MTPFLOW_PLAYGROUND_USER", "MTPFLOW_PLAYGROUND_PASSWORD"
API_KEY_ENV = "MTPFLOW_API_KEY"  # the server's (mtpflow.serve.build.API_KEY_ENV), read here without importing it


def login(args: argparse.Namespace):
    """Gradio's ``auth`` from ``--users`` / ``$MTPFLOW_PLAYGROUND_USERS``, ``$MTPFLOW_PLAYGROUND_USER`` with
    ``$MTPFLOW_PLAYGROUND_PASSWORD``, and ``--api-key-login``; None (no login) when none is set. Passwords come from
    a file or the environment, never the command line, which other users of the machine can read."""
    from mtpflow.errors import UserError
    from mtpflow.playground.server import login_check, read_users

    users = read_users(args.users) if args.users else {}
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if bool(user) != bool(password):
        raise UserError(f"set both {USER_ENV} and {PASSWORD_ENV}, or neither")
    if user:
        users[user] = password
    api_key = None
    if args.api_key_login:
        api_key = os.environ.get(API_KEY_ENV)
        if not api_key:
            raise UserError(f"--api-key-login needs the server's API key in {API_KEY_ENV}")
    return login_check(users, api_key)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mtpflow.playground", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=os.environ.get("MTPFLOW_PLAYGROUND_HOST", "127.0.0.1"),
                   help="interface to listen on (0.0.0.0 for every interface; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(os.environ.get("MTPFLOW_PLAYGROUND_PORT", "7860")),
                   help="port (default 7860; 0 picks a free one)")
    p.add_argument("--max-tokens", type=int, default=1024, help="the largest max-new-tokens a visitor may ask for")
    p.add_argument("--users", default=os.environ.get(USERS_ENV),
                   help=f"require a login: a file of user:password lines (or ${USERS_ENV})")
    p.add_argument("--api-key-login", action="store_true",
                   help=f"require a login: any user name with the server's API key (${API_KEY_ENV}) as password")
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

        auth = login(args)
        runner = PlaygroundRunner(tuple(args.overrides), max_tokens_cap=args.max_tokens)
        if not args.no_warmup:
            print(f"mtpflow playground: warm-up decode took {runner.warm_up():.2f} s", flush=True)
        app = create_server_app(build_blocks(runner), runner.trace_store(), auth=auth)
    except UserError as exc:
        print(f"mtpflow playground: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    port = args.port or free_port(args.host)
    if auth is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"mtpflow playground: warning: anyone who reaches {args.host}:{port} can run decodes; see "
              "docs/playground.md, 'Sharing beyond localhost' (--users, --api-key-login)", file=sys.stderr, flush=True)
    print(f"mtpflow playground: serving {runner.loaded.model_id} on http://{args.host}:{port}/ "
          f"(metrics on /metrics)", flush=True)
    uvicorn.run(app, host=args.host, port=port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
