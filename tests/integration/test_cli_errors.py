"""User mistakes give one clear line and exit status 2, never a traceback, before the model loads where
possible."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest

from mtpflow.cli import main

CASES = [
    (["strategy=nope", "prompt=hi"], "unknown strategy 'nope'; available:"),
    (["strategy=pld", "k=100", "prompt=hi"], "k must be"),
    (["strategy=pld", "strategy.select_k.k=-1", "prompt=hi"], "strategy.select_k.k must be"),
    (["temperature=-0.5", "prompt=hi"], "temperature must be"),
    (["top_p=0", "prompt=hi"], "top_p must be"),
    (["top_p=1.5", "prompt=hi"], "top_p must be"),
    (["prompt=   "], "empty prompt"),
    ([], "empty prompt"),  # no prompt= and an empty pipe on standard input
    (["prompt_file=/nonexistent/prompt.txt"], "cannot read prompt_file"),
    (["model.name=/nonexistent/model", "prompt=hi"], "model path not found"),
    (["max_new_tokens=0", "prompt=hi"], "max_new_tokens must be"),
    (["output=xml", "prompt=hi"], "output must be"),
    (["nosuchkey=1", "prompt=hi"], "bad configuration"),
    (["chat=maybe", "prompt=hi"], "chat must be true or false, got 'maybe'"),
    (["stop=''", "prompt=hi"], "stop must be a non-empty string"),
    (["stop=[true]", "prompt=hi"], "stop must be a non-empty string"),
    (["top_k=1.5", "prompt=hi"], "top_k must be a whole number >= 0"),
]


def test_stop_takes_one_value_or_a_list():
    """``stop=5`` (Hydra reads a number) and ``stop="x"`` mean the text; a list may mix them (was a TypeError)."""
    from mtpflow.config import compose, stop_strings

    assert stop_strings(compose(["stop=5"])) == ("5",)
    assert stop_strings(compose(["stop=[5,ab]"])) == ("5", "ab")
    assert stop_strings(compose(["stop=null"])) == stop_strings(compose([])) == ()


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(c[0]) or "no-args" for c in CASES])
def test_user_errors_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))  # an empty pipe, not a terminal (which opens the chat)
    assert main(argv + ["trace=off"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtpflow: error: ") and message in err, err
    assert len(err.splitlines()) == 1


def test_prompt_longer_than_context(tmp_path, capsys, default_loaded):
    path = tmp_path / "long.txt"
    path.write_text("word " * 9000)
    assert main([f"prompt_file={path}", "trace=off"]) == 2
    assert "context is 8192" in capsys.readouterr().err


def test_directory_as_prompt_file(tmp_path, capsys):
    assert main([f"prompt_file={tmp_path}", "trace=off"]) == 2
    assert "cannot read prompt_file" in capsys.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_output_on_a_terminal_needs_a_prompt(capsys, monkeypatch):
    """No prompt on a terminal opens the chat (tests/integration/test_chat.py), which has no JSON form."""
    monkeypatch.setattr(sys, "stdin", Terminal())
    assert main(["output=json", "trace=off"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtpflow: error: output=json needs a prompt") and len(err.splitlines()) == 1


def test_unreadable_standard_input_is_one_line(capsys, monkeypatch):
    class Broken(io.StringIO):
        def read(self, *args):
            raise OSError("Input/output error")

    monkeypatch.setattr(sys, "stdin", Broken())
    assert main(["trace=off"]) == 2
    assert capsys.readouterr().err.strip() == ("mtpflow: error: cannot read the prompt from standard input: "
                                               "Input/output error")


def test_subprocess_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "mtpflow", "strategy=nope", "prompt=hi"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "unknown strategy" in proc.stderr


def test_api_checks_prompt_ids():
    """The Python API takes a list or a [1, n] tensor of ids; an empty, nested, fractional or out-of-vocabulary
    list is a UserError naming the problem (was a reshape, overflow or index error deep in the model)."""
    import torch

    from helpers import hf_greedy, make_pipeline, tiny_loaded
    from mtpflow.errors import UserError

    loaded = tiny_loaded(seed=0)
    pipe = make_pipeline(loaded, "pld", "max_new_tokens=6", "trace=off")
    vocab = loaded.model.get_input_embeddings().num_embeddings
    for bad, message in (([], "non-empty flat list"), ([[1, 2], [3, 4]], "non-empty flat list"),
                         ([1.5, 2], "whole numbers"), ([[1, 2], [3]], "list of token ids"),
                         ([-1, 5], "got -1"), ([5, vocab], f"in \\[0, {vocab}\\), got {vocab}")):
        with pytest.raises(UserError, match=message):
            pipe(prompt_ids=bad)
    want = hf_greedy(loaded.model, [5, 6, 7], 6)
    assert pipe(prompt_ids=[5, 6, 7]).token_ids == pipe(prompt_ids=torch.tensor([[5, 6, 7]])).token_ids == want


def test_check_int_takes_whole_numbers_in_any_spelling():
    """One checker for every whole-number setting: ints, whole floats and numeric strings pass (Hydra may hand
    any of them); fractions, words, booleans, nan and inf fail with the bound in the message."""
    from mtpflow.errors import ConfigError, check_int

    assert [check_int("n", v, 0) for v in (3, 3.0, "3", "1e3")] == [3, 3, 3, 1000]
    for bad, message in ((1.5, ">= 0"), ("x", ">= 0"), (True, ">= 0"), (float("nan"), ">= 0"),
                         (float("inf"), ">= 0"), (-1, ">= 0")):
        with pytest.raises(ConfigError, match=f"n must be a whole number {message}, got"):
            check_int("n", bad, 0)
    with pytest.raises(ConfigError, match=r"in \[0, 16\], got 17"):
        check_int("n", 17, 0, 16)


def test_every_command_shares_one_frame(capsys):
    """``mtpflow.errors.run_command``, around python -m mtpflow, mtpflow.tune and the serve benchmark: help,
    a user's mistake as one line (exit 2), Ctrl-C as one line (exit 130); other errors are bugs and propagate."""
    from mtpflow.errors import ConfigError, run_command

    def fails(error):
        def run(argv):
            raise error
        return run

    assert run_command("mtpflow.x", fails(AssertionError()), ["--help"], "usage: x") == 0
    assert capsys.readouterr().out == "usage: x\n"
    assert run_command("mtpflow.x", lambda argv: len(argv), ["a", "b", "c"]) == 3  # the command's own status
    assert run_command("mtpflow.x", fails(ConfigError("k must be in [0, 64]")), ["k=99"]) == 2
    assert capsys.readouterr().err == "mtpflow.x: error: k must be in [0, 64]\n"
    assert run_command("mtpflow.x", fails(KeyboardInterrupt()), [], interrupted="interrupted (kept)") == 130
    assert capsys.readouterr().err == "\nmtpflow.x: interrupted (kept)\n"
    with pytest.raises(ZeroDivisionError):
        run_command("mtpflow.x", fails(ZeroDivisionError()), [])
