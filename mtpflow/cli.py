"""``python -m mtpflow [hydra overrides]``: decode one prompt (``prompt=``, ``prompt_file=`` or piped on standard
input), streaming accepted tokens to the terminal, then print a stats table (or one JSON document with
``output=json``); with no prompt on a terminal, an interactive chat (``mtpflow.chat``). User mistakes exit 2
with one line."""
from __future__ import annotations

import json
import sys

from mtpflow.chat import format_stats

USAGE = """usage: python -m mtpflow [key=value ...]

  strategy=NAME        decoding strategy (python -m mtpflow --strategies lists them)
  prompt="..."         the request (or prompt_file=PATH, or piped: echo "..." | python -m mtpflow);
                       chat=false skips the chat template. No prompt on a terminal: an interactive chat
  max_new_tokens=N     temperature=T top_k=N top_p=P seed=N k=K stop=["..."]
  model.name=ID|PATH   any HF causal LM or .gguf (default: embedded SmolLM2-135M-Instruct)
  output=json          one JSON document (text, token_ids, stats) instead of streaming
"""


def stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):  # closed or detached
        return False


def read_stdin_prompt() -> str:
    """The whole of standard input as the prompt (``echo "..." | python -m mtpflow``), less the final newline."""
    from mtpflow.errors import UserError

    try:
        text = "" if sys.stdin is None else sys.stdin.read()
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else str(exc) or type(exc).__name__
        raise UserError(f"cannot read the prompt from standard input: {reason}") from None
    text = text.rstrip("\r\n")
    if not text.strip():
        raise UserError("empty prompt: pass prompt=\"...\", prompt_file=PATH or text on standard input")
    return text


def main(argv: list[str] | None = None) -> int:
    from mtpflow.errors import run_command

    return run_command("mtpflow", decode, argv, USAGE)


def decode(argv: list[str]) -> int:
    """The command itself: compose, check, then decode the prompt or start the chat."""
    from mtpflow.config import available_strategies, compose, read_prompt, validate
    from mtpflow.errors import UserError
    from mtpflow.host import check_named_profile

    if "--strategies" in argv:
        print("\n".join(available_strategies()))
        return 0
    cfg = compose(argv)
    validate(cfg)
    check_named_profile(cfg.get("profile"))  # a damaged or foreign tuning profile: one line, before the load
    if cfg.get("prompt") is None and not cfg.get("prompt_file"):
        if stdin_is_terminal():
            if cfg.output == "json":
                raise UserError("output=json needs a prompt: prompt=\"...\", prompt_file=PATH or text piped "
                                "on standard input")
            return run_chat(cfg, argv)
        prompt = read_stdin_prompt()
    else:
        prompt = read_prompt(cfg)  # fail on an empty or unreadable prompt before the model loads
    from mtpflow.api import Pipeline
    from mtpflow.plugins.manager import default_run_plugins

    pipe = Pipeline(cfg, run_plugins=default_run_plugins(cfg))
    if cfg.output == "json":
        result = pipe(prompt)
        doc = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats,
               "strategy": pipe.strategy_name, "model": pipe.loaded.model_id}
        print(json.dumps(doc, ensure_ascii=False))
        return 0
    for piece in pipe.stream(prompt):
        sys.stdout.write(piece)
        sys.stdout.flush()
    result = pipe.last_result
    sys.stdout.write("\n\n")
    print(f"[{pipe.strategy_name} on {pipe.loaded.model_id}]")
    print(format_stats(result.stats))
    return 0


def run_chat(cfg, overrides: list[str]) -> int:
    """The chat for ``python -m mtpflow`` with no prompt on a terminal (``cfg`` composed from ``overrides``)."""
    from mtpflow.api import Pipeline
    from mtpflow.chat import Chat
    from mtpflow.plugins.manager import default_run_plugins

    print(f"mtpflow: loading {cfg.model.get('name') or 'the default model'} ...", file=sys.stderr, flush=True)
    return Chat(Pipeline(cfg, run_plugins=default_run_plugins(cfg)), overrides).run()
