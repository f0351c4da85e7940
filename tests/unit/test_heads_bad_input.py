"""Bad heads files: heads for another model (same shape), another vocabulary or another shape, and corrupt files
are one line: a UserError through the API, exit 2 through the command line; heads trained on the float32 model
load on its int8 model (the same model)."""
from __future__ import annotations

import dataclasses
import io
import json
import sys

import pytest
import torch

from helpers import make_pipeline, save_tiny_model, tiny_loaded
from mtpflow.errors import UserError
from mtpflow.strategies.head_modules import CONFIG_NAME, WEIGHTS_NAME, fingerprint, load_heads
from test_heads_lossless import one_thread, random_heads  # noqa: F401 (fixture)


def edit_config(folder, **changes):
    path = folder / CONFIG_NAME
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return folder


def heads_with_fingerprint(loaded, folder, kind="medusa"):
    """Random heads whose heads.json records ``loaded``'s fingerprint, as training writes it."""
    random_heads(loaded, kind, folder, draft_vocab=60)
    _, draft_ids, _ = load_heads(folder)
    return edit_config(folder, fingerprint=fingerprint(loaded.model, draft_ids))


def bad_heads(case: str, tmp_path):
    """A heads folder that is wrong for the tiny model of seed 0 in the way ``case`` names; (folder, message)."""
    folder = tmp_path / case
    if case == "another model":  # the same shape and vocabulary, other weights
        return heads_with_fingerprint(tiny_loaded(seed=1), folder), "trained for another model"
    if case == "another vocabulary":  # heads of a model whose vocabulary has 999 tokens
        random_heads(tiny_loaded(seed=0), "medusa", folder)
        return edit_config(folder, vocab_size=999), "vocab 999"
    if case == "another shape":
        return random_heads(tiny_loaded(seed=1, hidden=32), "eagle", folder), "hidden 32"
    random_heads(tiny_loaded(seed=0), "eagle", folder, draft_vocab=60)
    weights, config = folder / WEIGHTS_NAME, folder / CONFIG_NAME
    if case == "weights of another shape":  # heads.json says one hidden size, the tensors hold another
        random_heads(tiny_loaded(seed=1, hidden=32), "eagle", tmp_path / "small")
        weights.write_bytes((tmp_path / "small" / WEIGHTS_NAME).read_bytes())
        return folder, "does not hold the eagle heads"
    if case == "cut short":
        weights.write_bytes(weights.read_bytes()[:1000])
        return folder, "cannot be read"
    if case == "not safetensors":
        weights.write_bytes(b"\x00garbage" * 64)
        return folder, "cannot be read"
    if case == "config not JSON":
        config.write_text('{"kind": "eagle", ')
        return folder, "is not a heads config: not JSON"
    if case == "config without kind":
        edit_config(folder, kind=None)
        return folder, "'kind' is missing"
    if case == "draft ids out of range":
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        tensors["draft_ids"] = tensors["draft_ids"] + 10_000
        save_file(tensors, str(weights))
        return folder, "token ids outside the vocabulary"
    raise AssertionError(case)


CASES = ["another model", "another vocabulary", "another shape", "weights of another shape", "cut short",
         "not safetensors", "config not JSON", "config without kind", "draft ids out of range"]
MEDUSA = ("another model", "another vocabulary")  # the cases written as medusa heads; the others are eagle heads


@pytest.mark.parametrize("case", CASES)
def test_bad_heads_are_one_user_error(case, tmp_path):
    folder, message = bad_heads(case, tmp_path)
    kind = "medusa" if case in MEDUSA else "eagle"
    pipe = make_pipeline(tiny_loaded(seed=0), kind, "max_new_tokens=4",
                         "trace=off", f"strategy.propose.heads={folder}")
    with pytest.raises(UserError, match=message) as info:
        pipe(prompt_ids=[5, 6, 7])
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("case", CASES)
def test_bad_heads_on_the_command_line_are_one_line_exit_2(case, tmp_path, tiny_folder, capsys, monkeypatch):
    from mtpflow.cli import main

    folder, message = bad_heads(case, tmp_path)
    kind = "medusa" if case in MEDUSA else "eagle"
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    code = main(["model=hf", f"model.name={tiny_folder}", f"strategy={kind}", f"model.heads={folder}",
                 "prompt=hello", "max_new_tokens=4", "trace=off", "chat=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("mtpflow: error: ") and message in err and len(err.splitlines()) == 1, err


def test_heads_of_the_float_model_load_on_its_int8_model(tmp_path):
    """The int8 model's LM head rows are within the fingerprint's tolerance of the float32 rows they came from."""
    from mtpflow import backends

    loaded = tiny_loaded(seed=0)
    folder = heads_with_fingerprint(loaded, tmp_path / "m")
    try:
        int8 = dataclasses.replace(loaded, int8=backends.quantize_int8(loaded.model))
    except UserError as exc:
        pytest.skip(f"int8 model: {exc}")
    pipe = make_pipeline(int8, "medusa", "max_new_tokens=8", "trace=off", "model.quantize=int8",
                         f"strategy.propose.heads={folder}")
    assert len(pipe(prompt_ids=[5, 6, 7]).token_ids) == 8
    assert torch.is_tensor(load_heads(folder)[1])
