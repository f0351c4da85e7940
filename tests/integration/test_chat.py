"""``python -m mtpflow`` with no prompt: on a terminal an interactive multi-turn chat (driven here through a
pseudo-terminal: two turns, /stats, /strategy, Ctrl-C mid-answer, Ctrl-D), and a prompt piped on standard
input is the prompt. A tiny random Llama with a chat template, saved to a temporary folder, stands in for the
model; every answer is checked in the run's trace."""
from __future__ import annotations

import codecs
import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
import warnings

import pytest
import torch

from helpers import make_pipeline, make_tiny_model, make_tiny_tokenizer
from mtpflow.chat import Chat, conversation_ids
from mtpflow.traces import TraceStore

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = r">>> "


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Llama saved with a chat template; EOS (id 0) never wins, so an answer runs to max_new_tokens and
    a Ctrl-C lands mid-answer."""
    folder = tmp_path_factory.mktemp("tiny-chat-model")
    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = make_tiny_model(len(tok), seed=3)
    with torch.no_grad():
        model.lm_head.weight[0] = 0.0  # logit 0 for EOS; the best of the other 319 random logits is higher
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class Terminal:
    """A child process on a pseudo-terminal (its controlling terminal, so a typed Ctrl-C is a SIGINT): read
    what it prints, type at it."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        with warnings.catch_warnings():  # fork in a threaded process: the child only execs
            warnings.simplefilter("ignore", DeprecationWarning)
            pid, fd = pty.fork()
        if pid == 0:  # the child: become the program, never return into pytest
            try:
                # a pytest started in the background (``cmd &``) ignores SIGINT, and an ignored signal stays
                # ignored across exec: a typed Ctrl-C would not reach the chat
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # rows, columns
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.output, self.seen = "", 0
        self.status: int | None = None

    def _read(self, timeout: float) -> bool:
        """Append what arrives within ``timeout``; False once the child has closed the terminal."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: no process holds the terminal any more
            data = b""
        self.output += self.decoder.decode(data)
        return bool(data)

    def expect(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """The next match of ``pattern`` after the previous one; fails with the output when it does not come."""
        rx, deadline = re.compile(pattern), time.monotonic() + timeout
        while True:
            found = rx.search(self.output, self.seen)
            if found:
                self.seen = found.end()
                return found
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 1.0)):
                if (found := rx.search(self.output, self.seen)) is not None:
                    self.seen = found.end()
                    return found
                pytest.fail(f"{pattern!r} did not appear; the terminal shows:\n{self.output[-4000:]}")

    def wait_for_text(self, count: int, timeout: float = 120.0) -> None:
        """Until ``count`` visible characters follow the last match."""
        deadline = time.monotonic() + timeout
        while len("".join(plain(self.output[self.seen:]).split())) < count:
            if time.monotonic() > deadline or not self._read(1.0):
                pytest.fail(f"no answer streamed; the terminal shows:\n{self.output[-4000:]}")

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
            self._read(0.2)  # keep the terminal drained so the child never blocks on a write
        pytest.fail(f"the chat did not exit; the terminal shows:\n{self.output[-4000:]}")

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


def plain(text: str) -> str:
    """Terminal output without escape sequences and carriage returns."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")


def child_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env.update(TERM="xterm", MTPFLOW_LOAD_PLUGINS="", PYTHONUNBUFFERED="1", **extra)
    return env


def test_chat_in_a_terminal(chat_model, tmp_path):
    db = tmp_path / "traces.db"
    term = Terminal([sys.executable, "-m", "mtpflow", f"model.name={chat_model}", "strategy=baseline",
                     "max_new_tokens=8", f"trace.db={db}"], child_env())
    try:
        term.expect(r"mtpflow chat: baseline on ")
        term.expect(r"accepted draft tokens")  # a terminal with colors: the legend is shown
        term.expect(PROMPT)
        term.send("hello there\r")
        term.expect(PROMPT)
        term.send("what did I say?\r")
        term.expect(PROMPT)

        term.send("/stats\r")
        stats = term.expect(r"(?s)\[baseline on .*?stop reason\s+(\w+)")
        assert stats.group(1) == "max_new_tokens" and "MAL" in stats.group(0)
        assert re.search(r"tokens\s+8\b", plain(stats.group(0)))
        term.expect(PROMPT)

        term.send("/strategy nope\r")
        term.expect(r"mtpflow: error: unknown strategy 'nope'")  # one line, the chat goes on
        term.expect(PROMPT)
        term.send("/strategy pld\r")
        term.expect(r"strategy: pld")
        term.expect(PROMPT)

        term.send("/set max_new_tokens=900 strategy.propose.costs=null\r")  # no cost measuring: a fast test
        term.expect(PROMPT)
        term.send("tell me a long story\r")
        term.expect(r"story\r?\n")  # the echo of the line; then the answer streams
        term.wait_for_text(10)
        term.send("\x03")  # Ctrl-C
        term.expect(r"\[stopped\]")
        term.expect(PROMPT)
        term.send("/stats\r")
        term.expect(r"stopped")
        term.expect(PROMPT)

        term.send("/set max_new_tokens=4\r")
        term.expect(PROMPT)
        term.send("and now?\r")
        term.expect(PROMPT)
        term.send("\x04")  # Ctrl-D
        assert term.wait() == 0
    finally:
        term.close()
    assert "Traceback" not in term.output

    store = TraceStore(db)
    runs = sorted(store.list_runs(), key=lambda r: r["id"])
    assert [(r["strategy"], r["status"]) for r in runs] == [
        ("baseline", "complete"), ("baseline", "complete"), ("pld", "interrupted"), ("pld", "complete")]
    first, second, stopped, last = runs
    assert "hello there" in first["prompt"] and "what did I say?" not in first["prompt"]
    # the second turn sees the whole conversation: the first question, its answer, then the new question
    convo = second["prompt"]
    assert convo.index("hello there") < convo.index(first["output_text"]) < convo.index("what did I say?")
    assert convo.endswith("<|assistant|>")
    assert "tell me a long story" in last["prompt"] and last["prompt"].count("<|user|>") == 4


def test_prompt_piped_on_standard_input(chat_model, tmp_path):
    """``echo "..." | python -m mtpflow strategy=pld``: the pipe is the prompt (an empty pipe is the one-line
    "empty prompt" error: tests/integration/test_cli_errors.py)."""
    db = tmp_path / "traces.db"
    cmd = [sys.executable, "-m", "mtpflow", f"model.name={chat_model}", "strategy=pld", "strategy.propose.costs=null",
           "max_new_tokens=6", "output=json", f"trace.db={db}"]
    proc = subprocess.run(cmd, input="Summarize: the fox jumps\n", capture_output=True, text=True, timeout=300,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["new_tokens"] == 6
    run = TraceStore(db).list_runs()[0]
    assert run["prompt"] == "Summarize: the fox jumps"  # the final newline of echo dropped
    templated = make_tiny_tokenizer()
    templated.chat_template = CHAT_TEMPLATE
    assert run["prompt_tokens"] == len(conversation_ids(templated, [{"role": "user", "content": run["prompt"]}]))


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def scripted(*lines: str | BaseException):
    """``input`` for a chat: the lines (an exception is raised, as input() raises KeyboardInterrupt for a
    Ctrl-C), then Ctrl-D."""
    queue = list(lines)

    def read_line(prompt: str) -> str:
        if not queue:
            raise EOFError
        if isinstance(queue[0], BaseException):
            raise queue.pop(0)
        return queue.pop(0)

    return read_line


ACCEPTING = ("strategy.propose.layers=1", "strategy.propose.cost_aware=false")  # the tiny model's drafts land


def test_accepted_tokens_are_green_on_a_terminal_only(tiny, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    pipe = make_pipeline(tiny, "draft_model", "max_new_tokens=16", "chat=false", "trace=off", *ACCEPTING)
    out = FakeTerminal()
    chat = Chat(pipe, [], out=out, read_line=scripted("the quick brown fox jumps over the lazy dog"))
    assert chat.run() == 0
    result = chat.last_result
    assert result.stats["accepted_tokens"] > 0
    shown = out.getvalue()
    assert "\033[32m" in shown  # accepted: green, as in `python -m mtpflow.traces show`
    assert result.text in plain(shown)
    # no colors where the output is not a terminal, NO_COLOR is set (https://no-color.org) or TERM=dumb
    assert Chat(pipe, [], out=io.StringIO()).color is False
    monkeypatch.setenv("TERM", "dumb")
    assert Chat(pipe, [], out=FakeTerminal()).color is False
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("NO_COLOR", "1")
    assert Chat(pipe, [], out=FakeTerminal()).color is False
    assert Chat(pipe, [], out=FakeTerminal()).style("x", "accepted") == "x"


def test_commands_and_mistakes_cost_one_line(tiny):
    pipe = make_pipeline(tiny, "pld", "max_new_tokens=4", "chat=false", "trace=off")
    out = io.StringIO()
    chat = Chat(pipe, ["strategy=pld", "strategy.propose.min_ngram=1", "max_new_tokens=4", "chat=false",
                       "trace=off"], out=out,
                read_line=scripted("/stats", "/set model.name=x", "/set max_new_tokens", "/nope", "hi",
                                   "/strategy jacobi", "/strategy", "/set max_new_tokens=2", "again", "/stats",
                                   "/clear"))
    assert chat.run() == 0
    lines = out.getvalue().splitlines()
    assert "no answer yet" in lines
    assert any("model.name cannot change in a chat" in line for line in lines)
    assert any(line.startswith("mtpflow: error: usage: /set") for line in lines)
    assert any("unknown command /nope" in line for line in lines)
    # the strategy's own settings stay behind when it changes; the others carry over
    assert chat.pipe.strategy_name == "jacobi" and "strategy.propose.min_ngram=1" not in chat.overrides
    assert chat.last_result.stats["strategy"] == "jacobi" and chat.last_result.stats["new_tokens"] == 2
    assert "strategy: jacobi" in lines and chat.messages == []


def test_ctrl_c_at_the_prompt_leaves(tiny):
    pipe = make_pipeline(tiny, "pld", "max_new_tokens=4", "chat=false", "trace=off")
    assert Chat(pipe, [], out=io.StringIO(), read_line=scripted(KeyboardInterrupt(), "never read")).run() == 0


def test_conversation_ids_follow_the_template_or_plain_turns(tiny):
    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "and?"}]
    assert tok.decode(conversation_ids(tok, messages)) == "<|user|>hi\n<|assistant|>yo\n<|user|>and?\n<|assistant|>"
    assert tok.decode(conversation_ids(tok, messages, use_template=False)) == "hi\n\nyo\n\nand?\n\n"
    assert tok.decode(conversation_ids(tiny.tokenizer, messages)) == "hi\n\nyo\n\nand?\n\n"  # no template


def test_piped_prompt_is_the_prompt_in_process(chat_model, monkeypatch, capsys):
    from mtpflow.cli import main

    args = [f"model.name={chat_model}", "strategy=pld", "strategy.propose.costs=null", "max_new_tokens=6",
            "output=json", "trace=off"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("the quick brown fox\n"))
    assert main(args) == 0
    piped = json.loads(capsys.readouterr().out)
    assert main(args + ["prompt=the quick brown fox"]) == 0
    assert piped["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
