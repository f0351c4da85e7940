"""Weight-only int8 linears (``model.quantize=int8``): the int8 kernel of small_gemm.c against F.linear over
the dequantized weight, the model-level quantization (``mtpflow.backends.quantize_int8``: ``LoadedModel.int8``, whose
products the ``native_cpu`` backend runs), and greedy identity with HF generate on the same quantized model,
alone and in a batch."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers import hf_greedy, make_pipeline, tiny_loaded
from mtpflow import backends
from mtpflow.backends import native_cpu, quantize_int8
from mtpflow.errors import ConfigError, UserError
from mtpflow.kernels import native_linear
from mtpflow.model import check_quantize

needs_native = pytest.mark.skipif(not native_linear.available(), reason="no C compiler to build the native kernel")


@pytest.fixture
def int8_calls(monkeypatch):
    """A list that grows by one on every call of the int8 kernel: a test can check the decode really ran it."""
    calls = []
    real = native_linear.linear_int8
    monkeypatch.setattr(native_linear, "linear_int8", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _dequantized(w):
    q, scale = native_linear.quantize_int8(w)
    return q, scale, q.float() * scale[:, None]


def test_quantize_int8_round_trip():
    torch.manual_seed(0)
    w = torch.randn(37, 50)
    w[3] = 0.0  # a row of zeros: scale 1, q 0
    q, scale, deq = _dequantized(w)
    assert q.dtype == torch.int8 and scale.shape == (37,) and int(q.abs().max()) <= 127
    assert torch.all((w - deq).abs() <= scale[:, None] / 2 + 1e-7)  # rounding to the nearest step
    assert scale[3] == 1.0 and not q[3].any()
    assert torch.equal(native_linear.quantize_int8(deq)[0], q)  # quantizing the dequantized weight: the same q


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 17, 64])
@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (97, 48), (130, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_kernel_matches_f_linear_over_the_dequantized_weight(rows, shape, bias):
    out_f, in_f = shape
    torch.manual_seed(rows * 1000 + out_f)
    x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f)
    b = torch.randn(out_f) if bias else None
    q, scale, deq = _dequantized(w)
    got = native_linear.linear_int8(x, q, scale, b)
    torch.testing.assert_close(got, F.linear(x, deq, b), rtol=1e-4, atol=1e-4 * in_f ** 0.5)
    # each row's result does not depend on the other rows of the call (a verify forward's rows are apart)
    alone = torch.cat([native_linear.linear_int8(x[i:i + 1], q, scale, b) for i in range(rows)])
    assert torch.equal(got, alone)


@needs_native
def test_the_avx2_int8_build_matches_f_linear(tmp_path):
    cc = native_linear.compiler()
    out = tmp_path / "avx2.so"
    if not native_linear.build(cc, out, (*native_linear.FLAGS, "-mno-avx512f")):
        pytest.skip("the compiler cannot target AVX2 without AVX-512 here")
    lib = native_linear.load(out)
    assert lib.mtpflow_vector_width() == 8
    torch.manual_seed(1)
    for rows in (1, 3, 13):
        for out_f, in_f in ((5, 17), (130, 576)):
            x, w, b = torch.randn(rows, in_f), torch.randn(out_f, in_f), torch.randn(out_f)
            q, scale, deq = _dequantized(w)
            torch.testing.assert_close(native_linear.linear_int8(x, q, scale, b, lib=lib), F.linear(x, deq, b),
                                       rtol=1e-4, atol=1e-4 * in_f ** 0.5)


def int8_loaded(seed: int):
    """``tiny_loaded`` as ``load_model(quantize="int8")`` returns it: the weights dequantized in place, the int8
    copies in ``LoadedModel.int8``."""
    loaded = tiny_loaded(seed=seed)
    return dataclasses.replace(loaded, int8=quantize_int8(loaded.model))


@needs_native
def test_quantize_a_model_with_a_tied_lm_head(int8_calls):
    loaded = tiny_loaded(seed=3)
    model = loaded.model
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's
    before = model.lm_head.weight.detach().clone()
    classes = [type(m) for m in model.modules()]
    copies = quantize_int8(model)
    assert len(copies) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied: quantized in place
    q, scale = copies["lm_head"]
    assert q.dtype == torch.int8 and torch.equal(model.lm_head.weight, q.float() * scale[:, None])
    assert not torch.equal(model.lm_head.weight, before)
    assert [type(m) for m in model.modules()] == classes  # no class swapped: HF's forward is the reference
    backend = native_cpu.NativeCPUBackend(model, int8=copies)
    assert backend.int8 is not None and backend.describe().startswith("native_cpu int8 kernel:")
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.inference_mode():
        for layer in (model.model.layers[0].mlp.up_proj, model.lm_head):
            int8_calls.clear()
            torch.testing.assert_close(backend.module(layer, x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
            assert int8_calls  # through the int8 kernel, over the int8 copy
    assert torch.equal(quantize_int8(model)["lm_head"][0], q)  # again: the same int8 weights


def test_quantize_refuses_what_it_cannot_run():
    loaded = tiny_loaded(seed=3)
    with pytest.raises(ConfigError, match="must be null or one of int8"):
        check_quantize("int4")
    assert check_quantize(None) is None and check_quantize("int8") == "int8"
    with pytest.raises(UserError, match="float32 models on the CPU"):
        quantize_int8(loaded.model.to(torch.bfloat16))
    eager = tiny_loaded(seed=3).model
    eager.config._attn_implementation = "eager"  # a model the native_cpu backend does not run
    with pytest.raises(UserError, match=r"model.quantize=int8 \(the native_cpu backend\) does not apply here"):
        backends.create(eager, "auto", int8=quantize_int8(eager))


@pytest.mark.parametrize("overrides,message", [
    (["model.quantize=int4"], "model.quantize must be null or one of int8, got 'int4'"),
    (["model.quantize=int8", "model.backend=hf"],
     "model.quantize=int8 runs on the native_cpu backend: it needs model.backend=auto or native_cpu"),
])
def test_a_bad_quantize_setting_is_one_line(capsys, overrides, message):
    from mtpflow.cli import main

    assert main(["strategy=baseline", "prompt=hi", *overrides]) != 0
    assert capsys.readouterr().err.strip().splitlines() == [f"mtpflow: error: {message}"]


@needs_native
@pytest.mark.parametrize("strategy,overrides", [("baseline", []), ("pld", ["strategy.propose.costs=null"]),
                                                 ("jacobi", ["strategy.select_k.k=5"])])
def test_int8_decode_is_token_identical_to_hf_on_the_same_weights(strategy, overrides, int8_calls):
    loaded = int8_loaded(seed=5)
    ids = list(range(7, 27)) * 2
    ref = hf_greedy(loaded.model, ids, 40)  # HF generate over the dequantized weights: the same model
    pipe = make_pipeline(loaded, strategy, "max_new_tokens=40", "model.quantize=int8", *overrides)
    assert pipe.engine.backend.name == "native_cpu" and pipe.engine.backend.int8 is not None
    int8_calls.clear()
    assert pipe(prompt_ids=ids).token_ids == ref
    assert int8_calls  # through the int8 kernel, not the float fallback


@needs_native
def test_int8_decode_in_a_batch_is_token_identical_to_hf(int8_calls):
    from mtpflow.request import Request

    loaded = int8_loaded(seed=6)
    prompts = [list(range(5, 25)) * 2, list(range(40, 52)), [9, 8, 7, 9, 8, 7, 9, 8, 7, 100, 101]]
    refs = [hf_greedy(loaded.model, p, 30) for p in prompts]
    pipe = make_pipeline(loaded, "pld", "max_new_tokens=30", "model.quantize=int8", "strategy.propose.costs=null")
    assert pipe.engine.backend.int8 is not None
    int8_calls.clear()
    results = pipe.engine.generate([Request(prompt_ids=p, strategy=s) for p, s in
                                    zip(prompts, ["pld", "baseline", "jacobi"])])
    assert [r.token_ids for r in results] == refs
    assert int8_calls
