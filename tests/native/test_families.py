"""Every model family the native layer description knows (``tests/families.py``: a tiny random model of each, built
from its transformers config class, a sliding window shorter than these contexts where the family has one) on the
``native_cpu`` backend: what the description reads; every registered lossless strategy token-identical to HF
``generate`` greedy (float32) and to the int8 reference's greedy (``model.quantize=int8``), each request alone and
all of them in one engine batch (int8: the batch). The kernel's logits and taps against the ``hf`` backend and the int8 reference, on
every instruction set this CPU runs, are tests/native/test_native_harness.py's."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from families import FAMILIES, WINDOW, family_loaded, make_family_model
from helpers import make_pipeline
from mtpflow import backends
from mtpflow.backends.native import int8_reference as R, kernel
from mtpflow.backends.native.description import GELU_TANH, SILU, describe
from mtpflow.config import available_strategies, compose
from mtpflow.request import Request
from strategy_sweep import PROMPTS, hf_greedy_on, sweep_overrides

needs_native = pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the native kernel")
NEW_TOKENS = 12  # prompts of 8 to 18 tokens: every context passes the window (12) while it decodes

# what each family's description must say: (activation, sliding window per layer, rotary table per layer, q / k norms,
# norms after the blocks, biases on q/k/v, score soft-cap, logit soft-cap, embedding scale, tied head, fused q/k/v)
EXPECTED = {
    "llama": (SILU, [0] * 4, ["default"] * 4, False, False, False, 0.0, 0.0, None, False, False),
    "llama3": (SILU, [0] * 4, ["default"] * 4, False, False, False, 0.0, 0.0, None, True, False),
    "mistral": (SILU, [WINDOW] * 4, ["default"] * 4, False, False, False, 0.0, 0.0, None, False, False),
    "qwen2": (SILU, [0] + [WINDOW] * 3, ["default"] * 4, False, False, True, 0.0, 0.0, None, False, False),
    "qwen3": (SILU, [0] * 4, ["default"] * 4, True, False, False, 0.0, 0.0, None, True, False),
    "phi3": (SILU, [WINDOW] * 4, ["default"] * 4, False, False, False, 0.0, 0.0, None, False, True),
    "smollm3": (SILU, [0] * 4, ["default", None] * 2, False, False, False, 0.0, 0.0, None, True, False),
    "gemma": (GELU_TANH, [0] * 4, ["default"] * 4, False, False, False, 0.0, 0.0, 8.0, True, False),
    "gemma2": (GELU_TANH, [WINDOW, 0] * 2, ["default"] * 4, False, True, False, 5.0, 3.0, 8.0, True, False),
    "gemma3": (GELU_TANH, [WINDOW, 0] * 2, ["sliding_attention", "full_attention"] * 2, True, True, False, 0.0, 0.0,
               8.0, True, False),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_described_as_its_forward_computes(family):
    model = make_family_model(family, 96)
    d = describe(model)
    got = (d.activation, d.windows, [layer.rope for layer in d.layers], d.has("q_norm"), d.has("post_mlp"),
           d.layers[0].qkv[0].bias is not None, d.attn_softcap, d.logit_softcap, d.embed_scale, d.tied,
           len(d.layers[0].qkv) == 1)
    assert got == EXPECTED[family]
    assert d.rotary_dims == (8 if family == "phi3" else d.head_dim)  # Phi-3's partial rotary: half of 16
    gemma = family.startswith("gemma")  # the (1 + w) scale, computed once: the norms' weights start at zero
    assert torch.equal(d.layers[0].ln1, 1.0 + model.model.layers[0].input_layernorm.weight) if gemma else \
        d.layers[0].ln1 is model.model.layers[0].input_layernorm.weight


def _lossless() -> list[str]:
    return [s for s in available_strategies() if compose([f"strategy={s}"]).strategy.get("lossless", False)]


def _request(loaded, strategy: str, prompt: list[int], heads_dir) -> Request:
    overrides = {}
    for item in sweep_overrides(strategy, loaded, heads_dir):  # "strategy.propose.costs=null" -> {"propose.costs": None}
        key, _, value = item.partition("=")
        overrides[key.removeprefix("strategy.")] = yaml.safe_load(value)
    return Request(prompt_ids=prompt, strategy=strategy, overrides=overrides)


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("family-heads")


@needs_native
@pytest.mark.parametrize("precision", ["float32", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_lossless_strategy_on_each_family(family, precision, heads_dir):
    """Every registered lossless strategy over ``family``'s tiny model on the native_cpu backend, in one engine, all
    of them in one batch, and in float32 each request alone as well (one after the other): every output
    token-identical to HF ``generate`` greedy (float32) or to the int8 reference's greedy (int8). (Each int8 request
    alone is the Llama sweep's, tests/native/test_int8_model.py; the int8 kernel is bit for bit its reference for
    every family in tests/native/test_native_harness.py.)"""
    loaded = family_loaded(family)
    if precision == "int8":
        loaded = dataclasses.replace(loaded, int8=backends.quantize_int8(loaded.model))
        reference = R.Int8Reference(loaded.int8)
        wants = [reference.greedy(torch.tensor(p), NEW_TOKENS, loaded.eos_token_ids) for p in PROMPTS]
    else:
        wants = [hf_greedy_on(loaded.model, p, NEW_TOKENS) for p in PROMPTS]
    extra = ["model.quantize=int8"] if precision == "int8" else ["model.backend=native_cpu"]
    pipe = make_pipeline(loaded, "baseline", "trace=off", "temperature=0", f"max_new_tokens={NEW_TOKENS}",
                         "max_batch_size=32", *extra)
    engine = pipe.engine
    lossless = _lossless()
    try:
        assert engine.backend.describe().startswith("native_cpu cpu " + ("int8" if precision == "int8" else "float32"))
        if precision == "float32":
            for i, strategy in enumerate(lossless):
                alone = engine.generate(_request(loaded, strategy, PROMPTS[i % len(PROMPTS)], heads_dir))
                assert alone.token_ids == wants[i % len(PROMPTS)], f"{strategy} alone"
                assert "backend_fallbacks" not in alone.stats, strategy
        together = engine.generate([_request(loaded, s, PROMPTS[i % len(PROMPTS)], heads_dir)
                                    for i, s in enumerate(lossless)])
    finally:
        engine.close()
    for i, (strategy, result) in enumerate(zip(lossless, together)):
        assert result.token_ids == wants[i % len(PROMPTS)], f"{strategy} in the batch"
        assert "backend_fallbacks" not in result.stats, strategy
