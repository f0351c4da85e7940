"""``python -m mtpflow.train_heads`` is resumable: a run stopped by its time limit at every shard and step, or killed
(SIGKILL) in the middle of training, ends with exactly the heads of an uninterrupted run; the training text comes
from the target's own forwards through the engine's backend (the float32 model's greedy is HF's; the int8 model's is
its reference's), and heads trained on the int8 model's text decode over it exactly as its reference."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import hf_greedy, make_pipeline, save_tiny_model, tiny_loaded
from mtpflow import backends
from mtpflow.strategies.head_modules import WEIGHTS_NAME
from mtpflow.tools.head_data import Paused
from mtpflow.tools.train_heads import PAUSED, STATE_NAME, compose, main, run
from test_heads_lossless import one_thread  # noqa: F401 (fixture)

PROMPTS = ["the quick brown fox", "def add(a, b):", "speculative decoding drafts", "Summarize the text"]


def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    return path


def settings(tmp_path, name: str, *extra: str) -> list[str]:
    return [f"out={tmp_path / name / 'heads'}", f"data.folder={tmp_path / name / 'data'}",
            f"data.prompts={prompt_file(tmp_path)}", "data.samples=4", "data.batch_size=2", "data.max_new_tokens=12",
            "chat=false", "draft_vocab=64", "threads=1", "medusa.num_heads=2", "medusa.steps=9", "medusa.eval_every=4",
            "eagle.steps=9", "eagle.eval_every=4", "eagle.window=8", "eagle.sequence_length=8",
            "eagle.intermediate_size=32", "eagle.batch_sequences=2", "checkpoint_every=4", *extra]


def same_heads(a, b) -> None:
    for kind in ("medusa", "eagle"):
        left, right = load_file(str(a / kind / WEIGHTS_NAME)), load_file(str(b / kind / WEIGHTS_NAME))
        assert left.keys() == right.keys()
        for name in left:
            assert torch.equal(left[name], right[name]), (kind, name)


def test_a_run_stopped_at_every_shard_and_step_ends_as_an_uninterrupted_one(tmp_path):
    loaded = tiny_loaded(seed=0)
    whole = run(compose(settings(tmp_path, "whole")), loaded=loaded)
    cfg = compose(settings(tmp_path, "sliced", "time_limit_minutes=1e-9"))  # every slice: one shard or one step
    slices = 0
    while True:
        try:
            sliced = run(cfg, loaded=loaded)
            break
        except Paused:
            slices += 1
            assert slices < 40
    assert slices == (2 - 1) + (9 - 1) + (9 - 1)  # after each shard and step but the last of each phase
    same_heads(whole, sliced)
    for shard in ("shard_00000.pt", "shard_00001.pt"):  # the same text, shard by shard
        sliced_records = torch.load(tmp_path / "sliced" / "data" / shard)
        whole_records = torch.load(tmp_path / "whole" / "data" / shard)
        assert len(sliced_records) == len(whole_records)
        for a, b in zip(sliced_records, whole_records):
            assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["greedy"], b["greedy"])
    # the finished run again: nothing left to do, the same heads
    assert run(compose(settings(tmp_path, "sliced")), loaded=loaded) == sliced
    same_heads(whole, sliced)


def test_the_command_says_when_it_stopped_and_exits_3(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "model")
    argv = ["model=hf", f"model.name={folder}", *settings(tmp_path, "cli", "time_limit_minutes=1e-9")]
    assert main(argv) == PAUSED
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("mtpflow.train_heads: time limit reached (training text: 1/2 batches written); saved: run the "
                   "same command again to continue")


def state_step(path) -> int:
    try:
        return int(torch.load(path, weights_only=False).get("step", 0))
    except Exception:  # noqa: BLE001 (not written yet)
        return 0


def test_a_killed_run_continues_to_the_same_heads(tmp_path):
    folder = save_tiny_model(tmp_path / "model")
    base = [sys.executable, "-m", "mtpflow.train_heads", "model=hf", f"model.name={folder}", "kinds=[medusa,eagle]"]
    common = settings(tmp_path, "x")[2:] + [f"data.folder={tmp_path / 'data'}", "eagle.steps=3000",
                                            "checkpoint_every=50", "eagle.eval_every=500"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = [*base, *common, f"out={tmp_path / 'killed'}"]
    proc = subprocess.Popen(killed, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = tmp_path / "killed" / "eagle" / STATE_NAME
    deadline = time.monotonic() + 300
    while state_step(state) < 200 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    stopped = state_step(state)
    assert 200 <= stopped < 3000
    resumed = subprocess.run(killed, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"eagle: continuing from step {stopped} of 3000" in resumed.stderr
    assert "medusa: trained already" in resumed.stderr
    whole = subprocess.run([*base, *common, f"out={tmp_path / 'whole'}"], env=env, capture_output=True, text=True,
                           timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    same_heads(tmp_path / "whole", tmp_path / "killed")


def test_an_unfinished_run_of_other_settings_is_not_overwritten(tmp_path):
    from mtpflow.errors import UserError

    loaded = tiny_loaded(seed=0)
    with pytest.raises(Paused):
        run(compose(settings(tmp_path, "a", "time_limit_minutes=1e-9", "kinds=[eagle]", "data.samples=2")),
            loaded=loaded)
    with pytest.raises(Paused):
        run(compose(settings(tmp_path, "a", "time_limit_minutes=1e-9", "kinds=[eagle]", "data.samples=2")),
            loaded=loaded)  # one eagle step: an unfinished state
    with pytest.raises(UserError, match="unfinished run with other settings or data: pass resume=false"):
        run(compose(settings(tmp_path, "a", "kinds=[eagle]", "data.samples=2", "eagle.lr=0.01")), loaded=loaded)
    run(compose(settings(tmp_path, "a", "kinds=[eagle]", "data.samples=2", "eagle.lr=0.01", "resume=false")),
        loaded=loaded)


def test_the_text_is_the_targets_own_greedy_float32_and_int8(tmp_path):
    """Shard 0 is written at temperature 0: every sequence's continuation is the target's greedy (HF's for the float32
    model, the int8 reference's for the int8 model); heads trained on the int8 model's text say so and decode over it
    exactly as its reference."""
    loaded = tiny_loaded(seed=0)
    out = run(compose(settings(tmp_path, "f32", "kinds=[]")), loaded=loaded)
    for record in torch.load(out / "shard_00000.pt"):
        prompt, n = record["tokens"][: record["prompt_len"]].tolist(), record["prompt_len"]
        made = record["tokens"][n:].tolist()
        assert made == hf_greedy(loaded.model, prompt, 12)[: len(made)]
        assert record["hidden"].shape[0] == record["greedy"].shape[0] == record["tokens"].numel() - 1
    int8 = tiny_loaded(seed=0)
    int8 = dataclasses.replace(int8, int8=backends.quantize_int8(int8.model))
    reference = backends.int8_reference(int8.int8)
    heads = run(compose(settings(tmp_path, "int8", "model.quantize=int8")), loaded=int8)
    for record in torch.load(tmp_path / "int8" / "data" / "shard_00000.pt"):
        prompt, n = record["tokens"][: record["prompt_len"]], record["prompt_len"]
        made = record["tokens"][n:].tolist()
        assert made == reference.greedy(prompt.long(), 12, int8.eos_token_ids)[: len(made)]
    config = json.loads((heads / "eagle" / "heads.json").read_text())
    assert config["target"] == "int8"
    for ids in ([5, 6, 7, 8], [9, 10, 11, 9, 10]):
        pipe = make_pipeline(int8, "eagle", "max_new_tokens=16", "trace=off", "model.quantize=int8",
                             f"model.heads={heads}", "strategy.prune.0.costs=null")
        assert pipe(prompt_ids=ids).token_ids == reference.greedy(torch.tensor(ids), 16, int8.eos_token_ids)
