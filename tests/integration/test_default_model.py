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


def test_the_int8_model_is_lossless_against_its_reference(default_loaded):
    """model.quantize=int8 on the default model: baseline, mtp_heads and pld through the W8A8 kernel equal the int8
    reference's greedy (``Int8Reference``, torch) token for token, alone and as one engine batch; the kernel's
    prefill logits are bit-identical to the reference's; drafts are accepted; the float32 model is untouched and the
    int8 model's float32 layer weights are gone."""
    from mtpflow.backends.native import kernel, products
    from mtpflow.backends.native.int8_reference import Int8Reference
    from mtpflow.model import load_model
    from mtpflow.request import Request
    from helpers import prompt_rows

    if not kernel.available():
        pytest.skip("no C compiler to build the native kernel")
    loaded = load_model("smollm2", quantize="int8")
    assert loaded.model is not default_loaded.model and default_loaded.model.model.layers[0].mlp.up_proj.weight.numel()
    assert loaded.model.model.layers[0].mlp.up_proj.weight.numel() == 0  # no float32 copy beside the int8 one
    reference = Int8Reference(loaded.int8)
    pipe = make_pipeline(loaded, "baseline", "max_new_tokens=32", "trace=off", "model.quantize=int8")
    prompts = [pipe.encode(p) for p in PROMPTS]
    wants = [reference.greedy(ids, 32, loaded.eos_token_ids) for ids in prompts]
    reference.reset()
    logits, _, _ = reference.forward(prompts[0])
    target_logits = pipe.engine.backend.run(pipe.engine.backend.make_pool(1), prompt_rows(prompts[0], 0))[0]
    assert torch.equal(target_logits, logits)
    for strategy in ("baseline", "mtp_heads", "pld"):
        pipe = make_pipeline(loaded, strategy, "max_new_tokens=32", "trace=off", "model.quantize=int8")
        assert pipe.engine.backend.describe().startswith("native_cpu cpu int8 w8a8")
        accepted = 0
        for ids, want in zip(prompts, wants):
            result = pipe(prompt_ids=ids)
            assert result.token_ids == want, strategy
            accepted += result.stats["accepted_tokens"]
        assert strategy == "baseline" or accepted > 5, strategy
    results = pipe.engine.generate([Request(prompt_ids=ids, strategy=s) for ids, s in
                                    zip(prompts, ("pld", "baseline", "mtp_heads"))])
    assert [r.token_ids for r in results] == wants


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
