"""The interactive chat of ``python -m mtpflow`` (no prompt, standard input a terminal): a multi-turn
conversation through the tokenizer's chat template, each answer streamed as it is decoded, with draft tokens
the gate accepted colored where the terminal allows. Commands: ``/stats``, ``/strategy NAME``, ``/set KEY=VALUE``,
``/clear``, ``/help``; Ctrl-C stops the current answer, Ctrl-D (or Ctrl-C at the prompt) leaves.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable

from mtpflow.errors import UserError

HELP = """commands:
  /stats             figures of the last answer (tokens, MAL, tokens/s, acceptance, ...)
  /strategy NAME     decode with another strategy (the model stays loaded); /strategies lists them
  /set KEY=VALUE     change a setting for the next answers, e.g. /set max_new_tokens=256 temperature=0.7
  /clear             start a new conversation
  /help              this list
Ctrl-C stops the current answer; Ctrl-D (or Ctrl-C at the prompt) leaves."""
PROMPT = ">>> "
# Settings a chat cannot change: the model is loaded once, the prompt is what you type, the output streams.
FIXED_KEYS = ("model", "prompt", "prompt_file", "output")


def format_stats(stats: dict) -> str:
    rows = [
        ("tokens", stats.get("new_tokens")),
        ("forward passes", stats.get("forward_passes")),
        ("MAL (tokens / verify forward)", stats.get("mal")),
        ("tokens/s", stats.get("tokens_per_second")),
        ("acceptance rate", stats.get("acceptance_rate")),
        ("time to first token (s)", stats.get("time_to_first_token")),
        ("hit rate", stats.get("mtp_hit_rate")),
        ("avg K", stats.get("mtp_avg_k_used")),
        ("error propagation rate", stats.get("mtp_error_propagation_rate")),
        ("stop reason", stats.get("stop_reason")),
    ]
    known = {"new_tokens", "forward_passes", "mal", "tokens_per_second", "acceptance_rate", "time_to_first_token",
             "mtp_hit_rate", "mtp_avg_k_used", "mtp_error_propagation_rate", "stop_reason", "verify_forwards",
             "prefill_seconds", "total_seconds", "draft_tokens", "proposed_tokens", "accepted_tokens",
             "forward_passes_per_token"}
    rows += [(k, v) for k, v in stats.items() if k not in known and not isinstance(v, (dict, list))]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def override_key(override: str) -> str:
    """``strategy.select_k.k`` for ``+strategy.select_k.k=4`` (the dotted key an override sets)."""
    return override.split("=", 1)[0].lstrip("+~")


def conversation_ids(tokenizer, messages: list[dict], use_template: bool = True) -> list[int]:
    """Token ids of the conversation so far, ending with the generation prompt of the assistant's turn; without
    a chat template (or with chat=false) the turns as plain text, one paragraph each."""
    if use_template and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]
    text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


class Chat:
    """One conversation with a :class:`~mtpflow.api.Pipeline`; ``/strategy`` and ``/set`` swap the pipeline for
    one composed from the new overrides, on the same loaded model. ``read_line`` and ``out`` are ``input`` and
    standard output unless a test hands in others."""

    def __init__(self, pipe, overrides: list[str], out=None, read_line: Callable[[str], str] = input,
                 color: bool | None = None):
        from mtpflow.traces.cli import use_color

        self.pipe = pipe
        self.overrides = list(overrides)
        self.out = out or sys.stdout
        self.read_line = read_line
        if color is None:  # a terminal that says it has no colors (TERM=dumb) gets none
            color = use_color("auto", self.out) and os.environ.get("TERM") != "dumb"
        self.color = color
        self.messages: list[dict] = []
        self.last_result = None  # the last answer that ran to its end
        self.last_stopped = False

    # -- output -------------------------------------------------------------------------------------------
    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def style(self, piece: str, kind: str) -> str:
        from mtpflow.traces.cli import RESET, STYLES

        # accepted and bonus tokens are the ones a verify forward gave for free; the rest stays plain to read
        code = STYLES.get(kind, "") if self.color and kind in ("accepted", "bonus") else ""
        return f"{code}{piece}{RESET}" if code and piece else piece

    def banner(self) -> None:
        p = self.pipe
        self.say(f"mtpflow chat: {p.strategy_name} on {p.loaded.model_id}. /help for commands, Ctrl-D leaves.")
        if self.color:
            self.say(f"{self.style('green', 'accepted')}: accepted draft tokens, {self.style('cyan', 'bonus')}: "
                     "bonus tokens (both came with a verify forward)")

    # -- the conversation ---------------------------------------------------------------------------------
    def prompt_ids(self) -> list[int]:
        """The conversation as token ids; the oldest exchanges are dropped while it does not fit the model's
        context (UserError when the last message alone does not)."""
        cfg, loaded = self.pipe.cfg, self.pipe.loaded
        system = [{"role": "system", "content": str(cfg.system_prompt)}] if cfg.get("system_prompt") else []
        while True:
            ids = conversation_ids(loaded.tokenizer, system + self.messages, bool(cfg.chat))
            if len(ids) + 1 <= loaded.max_context:
                return ids
            if len(self.messages) <= 1:
                self.messages.clear()
                raise UserError(f"the message is {len(ids)} tokens; the model's context is {loaded.max_context}")
            del self.messages[:2]  # the oldest user message and its answer
            self.say(f"(dropped the oldest exchange to fit the model's context of {loaded.max_context} tokens)")

    def answer(self, text: str) -> None:
        """Decode the assistant's answer to ``text``, printing it as tokens commit; Ctrl-C stops it (the run is
        recorded interrupted) and what was shown stays in the conversation."""
        from mtpflow.types import PLAIN

        self.messages.append({"role": "user", "content": text})
        ids = self.prompt_ids()
        tokenizer = self.pipe.loaded.tokenizer
        emitted: list[int] = []
        shown = [""]  # the answer's text as printed so far
        lock = threading.Lock()  # the decode may call on_step from its own thread
        stopped = [False]

        def on_step(record, tokens):
            kinds = record.emitted_kinds if record is not None else (PLAIN,) * len(tokens)
            with lock:
                if stopped[0]:  # a step that ends after Ctrl-C prints nothing
                    return
                for token, kind in zip(tokens, kinds):
                    emitted.append(token)
                    decoded = tokenizer.decode(emitted, skip_special_tokens=True)
                    if decoded.endswith("\ufffd"):  # wait for a complete UTF-8 character
                        continue
                    self.out.write(self.style(decoded[len(shown[0]):], kind))
                    shown[0] = decoded
                self.out.flush()

        try:
            result = self.pipe(prompt_ids=ids, on_step=on_step)
        except KeyboardInterrupt:
            with lock:
                stopped[0] = True
            self.say("\n[stopped]")
            self.last_stopped = True
            if shown[0]:  # what was shown stays in the conversation, as in other chat tools
                self.messages.append({"role": "assistant", "content": shown[0]})
            else:
                self.messages.pop()
            return
        except BaseException:
            with lock:
                stopped[0] = True
            self.messages.pop()
            if shown[0]:
                self.say()
            raise
        with lock:
            stopped[0] = True
            if result.text.startswith(shown[0]):  # e.g. a last character that never completed
                self.out.write(result.text[len(shown[0]):])
        self.last_result, self.last_stopped = result, False
        self.messages.append({"role": "assistant", "content": result.text})
        self.say("\n")

    # -- commands -----------------------------------------------------------------------------------------
    def rebuild(self, overrides: list[str]) -> None:
        """Swap in a pipeline composed from ``overrides``, on the loaded model; the old one stays on error."""
        self.pipe = self.pipe.with_overrides(overrides)
        self.overrides = overrides

    def command(self, line: str) -> None:
        name, _, rest = line.partition(" ")
        args = rest.split()
        if name in ("/help", "/?"):
            self.say(HELP)
        elif name == "/stats":
            self.show_stats()
        elif name == "/strategies":
            from mtpflow.config import available_strategies

            self.say(" ".join(available_strategies()))
        elif name == "/strategy":
            if len(args) != 1:
                self.say(f"strategy: {self.pipe.strategy_name} (switch with /strategy NAME; /strategies lists them)")
                return
            # the old strategy's own settings (strategy.*) do not carry over to another strategy
            kept = [o for o in self.overrides if override_key(o).split(".")[0] != "strategy"]
            self.rebuild(kept + [f"strategy={args[0]}"])
            self.say(f"strategy: {self.pipe.strategy_name}")
        elif name == "/set":
            if not args or any("=" not in a for a in args):
                raise UserError("usage: /set KEY=VALUE ... (Hydra overrides, e.g. /set max_new_tokens=256)")
            keys = {override_key(a) for a in args}
            fixed = sorted(k for k in keys if k.split(".")[0] in FIXED_KEYS)
            if fixed:
                raise UserError(f"{', '.join(fixed)} cannot change in a chat (restart python -m mtpflow to change it)")
            self.rebuild([o for o in self.overrides if override_key(o) not in keys] + args)
            self.say("set " + " ".join(args))
        elif name == "/clear":
            self.messages.clear()
            self.say("(new conversation)")
        else:
            self.say(f"unknown command {name}; /help lists them")

    def show_stats(self) -> None:

        if self.last_result is None:
            self.say("no answer yet" if not self.last_stopped else "the last answer was stopped: no figures")
            return
        if self.last_stopped:
            self.say("(the last answer was stopped; figures of the one before)")
        stats = self.last_result.stats
        self.say(f"[{stats.get('strategy', self.pipe.strategy_name)} on {self.pipe.loaded.model_id}]")
        self.say(format_stats(stats))

    def run(self) -> int:
        """Read, answer, repeat; 0 when the user leaves."""
        history = open_history() if self.read_line is input else (lambda: None)
        self.banner()
        try:
            while True:
                try:
                    line = self.read_line(PROMPT).strip()
                except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt: leave
                    self.say()
                    return 0
                if not line:
                    continue
                try:
                    if line.startswith("/"):
                        self.command(line)
                    else:
                        self.answer(line)
                except UserError as exc:  # a mistake costs one line, never the conversation
                    self.say(f"mtpflow: error: {exc}")
                except KeyboardInterrupt:  # Ctrl-C during a command: back to the prompt
                    self.say("\n[stopped]")
        finally:
            history()


def open_history() -> Callable[[], None]:
    """Line editing and history (kept in the cache folder) where ``readline`` exists; returns the saver."""
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline
        return lambda: None
    from mtpflow.machine import cache_dir

    path = cache_dir() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass

    return save
