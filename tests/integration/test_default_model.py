"""The embedded default model (SmolLM2-135M-Instruct): lossless strategies equal HF greedy generate token
for token on a handful of prompts, and the CLI's output modes work end to end."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import hf_greedy, make_pipeline

pytestmark = pytest.mark.default_model

PROMPTS = [
    "Summarize: The meeting moved from Tuesday to Thursday at 3 pm because the client asked for more time to "
    "review the proposal. Please bring the revised budget numbers.",
    "Rename the variable x to total:\n\ndef f(values):\n    x = 0\n    for v in values:\n        x += v\n    return x",
    "What is the capital of France?",
]


@pytest.mark.parametrize("strategy", ["pld", "adaptive", "jacobi"])
def test_default_model_lossless(default_loaded, strategy):
    pipe = make_pipeline(default_loaded, strategy, "max_new_tokens=32", "trace=off")
    drafted = 0
    for prompt in PROMPTS:
        ids = pipe.encode(prompt).tolist()
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(default_loaded.model, ids, 32), prompt[:30]
        drafted += result.stats["accepted_tokens"]
    if strategy in ("pld", "adaptive"):
        assert drafted > 5  # prompt lookup really accepted drafts on these copy-heavy prompts


def test_int8_weights_are_lossless_against_hf_on_the_same_weights(default_loaded, monkeypatch):
    """model.quantize=int8: mtp and pld through the int8 kernel (the native_cpu backend over
    ``LoadedModel.int8``) equal HF generate over the dequantized weights (the same model in float32, HF's own
    forward) token for token; drafts are accepted."""
    from mtpflow.kernels import native_linear
    from mtpflow.model import load_model

    if not native_linear.available():
        pytest.skip("no C compiler to build the native kernel")
    loaded = load_model("smollm2", quantize="int8")
    assert loaded.model is not default_loaded.model  # the float32 model is untouched
    assert loaded.int8 and len(loaded.int8) == sum(isinstance(m, torch.nn.Linear) for m in loaded.model.modules())
    calls = []
    real = native_linear.linear_int8
    monkeypatch.setattr(native_linear, "linear_int8", lambda *a, **k: calls.append(1) or real(*a, **k))
    for strategy in ("mtp_heads", "pld"):
        pipe = make_pipeline(loaded, strategy, "max_new_tokens=32", "trace=off", "model.quantize=int8")
        assert pipe.engine.backend.name == "native_cpu" and pipe.engine.backend.int8 is not None
        accepted = 0
        for prompt in PROMPTS:
            ids = pipe.encode(prompt).tolist()
            result = pipe(prompt_ids=ids)
            assert result.token_ids == hf_greedy(loaded.model, ids, 32), (strategy, prompt[:30])
            accepted += result.stats["accepted_tokens"]
        assert accepted > 5, strategy
    assert calls  # the decode ran the int8 kernel


def test_api_decodes_many_prompts_with_one_model(default_loaded):
    pipe = make_pipeline(default_loaded, "pld", "max_new_tokens=16", "trace=off")
    results = [pipe(p) for p in PROMPTS[:2]]
    assert all(r.text and r.stats["new_tokens"] <= 16 for r in results)
    streamed = "".join(pipe.stream(PROMPTS[2]))
    assert streamed.strip() and streamed == pipe.last_result.text


def test_cli_json_prompt_file_and_chat_false(tmp_path, default_loaded):
    path = tmp_path / "prompt.txt"
    path.write_text("def fibonacci(n):")
    cmd = [sys.executable, "-m", "mtpflow", "strategy=pld", f"prompt_file={path}", "chat=false", "output=json",
           "max_new_tokens=12", "trace=off"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) >= {"text", "token_ids", "stats"} and len(doc["token_ids"]) == doc["stats"]["new_tokens"]
    ids = default_loaded.tokenizer("def fibonacci(n):")["input_ids"]
    assert doc["token_ids"] == hf_greedy(default_loaded.model, ids, 12)


def test_cli_streams_text_then_stats(default_loaded):
    proc = subprocess.run([sys.executable, "-m", "mtpflow", "strategy=pld", "prompt=Say hello in French.",
                           "max_new_tokens=8", "trace=off"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for label in ("tokens", "forward passes", "MAL", "tokens/s", "acceptance rate", "time to first token"):
        assert label in proc.stdout
