"""Weight-only int8 linears (``model.quantize=int8``): the int8 kernel of small_gemm.c against F.linear over
the dequantized weight, the model-level quantization, and greedy identity with HF generate on the same
quantized model, alone and in a batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import hf_greedy, make_pipeline, tiny_loaded
from mtpflow.errors import UserError
from mtpflow.kernels import cpu_linear, native_linear

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


@needs_native
def test_quantize_a_model_with_a_tied_lm_head():
    loaded = tiny_loaded(seed=3)
    model = loaded.model
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's
    cpu_linear.install(model, plans=("native",) * len(cpu_linear.ROW_BUCKETS))
    before = model.lm_head.weight.detach().clone()
    assert cpu_linear.quantize(model, "int8") == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied: quantized in place
    q, scale = model.lm_head._mtpflow_int8
    assert torch.equal(model.lm_head.weight, q.float() * scale[:, None])
    assert not torch.equal(model.lm_head.weight, before)
    with torch.inference_mode(), cpu_linear.packed():
        assert cpu_linear.state(model).startswith("int8 native:")
        x = torch.randn(1, 3, model.config.hidden_size)
        layer = model.model.layers[0].mlp.up_proj
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert cpu_linear.state(model) == "stock"  # outside packed(): plain F.linear over the dequantized weights
    cpu_linear.quantize(model, "int8")  # idempotent
    assert torch.equal(model.lm_head._mtpflow_int8[0], q)


def test_quantize_refuses_what_it_cannot_run():
    loaded = tiny_loaded(seed=3)
    with pytest.raises(UserError, match="must be null or one of int8"):
        cpu_linear.quantize(loaded.model, "int4")
    with pytest.raises(UserError, match="float32 models on the CPU"):
        cpu_linear.quantize(loaded.model.to(torch.bfloat16), "int8")


@pytest.mark.parametrize("overrides,message", [
    (["model.quantize=int4"], "model.quantize must be null or one of int8, got 'int4'"),
    (["model.quantize=int8", "model.cpu_linear=stock"],
     "model.quantize=int8 runs through mtpflow's CPU linears: it needs model.cpu_linear=auto or packed"),
])
def test_a_bad_quantize_setting_is_one_line(capsys, overrides, message):
    from mtpflow.cli import main

    assert main(["strategy=baseline", "prompt=hi", *overrides]) != 0
    assert capsys.readouterr().err.strip().splitlines() == [f"mtpflow: error: {message}"]


@needs_native
def test_quantize_needs_no_install_and_runs_past_the_packing_budget(monkeypatch, int8_calls):
    """A model too large for ``auto`` packing (here: a budget of 0 bytes) still runs int8: quantize makes its
    linears PackedLinear without timing float plans, and ``should_pack`` turns the CPU linears on for it."""
    monkeypatch.setattr(cpu_linear, "AUTO_MAX_BYTES", 0)
    loaded = tiny_loaded(seed=4)
    assert not cpu_linear.should_pack("auto", loaded.model)
    monkeypatch.setattr(cpu_linear, "load_plans", lambda model: pytest.fail("no plans are timed for int8"))
    cpu_linear.quantize(loaded.model, "int8")
    assert cpu_linear.is_quantized(loaded.model)
    assert cpu_linear.should_pack("auto", loaded.model) and not cpu_linear.should_pack("stock", loaded.model)
    ids = list(range(7, 27)) * 2
    pipe = make_pipeline(loaded, "pld", "max_new_tokens=24", "strategy.propose.costs=null")
    assert pipe(prompt_ids=ids).token_ids == hf_greedy(loaded.model, ids, 24)
    assert int8_calls  # the decode really ran the int8 kernel


@needs_native
@pytest.mark.parametrize("strategy,overrides", [("baseline", []), ("pld", ["strategy.propose.costs=null"]),
                                                 ("jacobi", ["strategy.select_k.k=5"])])
def test_int8_decode_is_token_identical_to_hf_on_the_same_weights(strategy, overrides, int8_calls):
    loaded = tiny_loaded(seed=5)
    cpu_linear.install(loaded.model, plans=("native",) * len(cpu_linear.ROW_BUCKETS))
    cpu_linear.quantize(loaded.model, "int8")
    ids = list(range(7, 27)) * 2
    ref = hf_greedy(loaded.model, ids, 40)  # HF generate over the dequantized weights: the same model
    pipe = make_pipeline(loaded, strategy, "max_new_tokens=40", "model.cpu_linear=auto", *overrides)
    assert pipe(prompt_ids=ids).token_ids == ref
    assert int8_calls  # through the int8 kernel, not the float fallback


@needs_native
def test_int8_decode_in_a_batch_is_token_identical_to_hf(int8_calls):
    from mtpflow.request import Request

    loaded = tiny_loaded(seed=6)
    cpu_linear.install(loaded.model, plans=("native",) * len(cpu_linear.ROW_BUCKETS))
    cpu_linear.quantize(loaded.model, "int8")
    prompts = [list(range(5, 25)) * 2, list(range(40, 52)), [9, 8, 7, 9, 8, 7, 9, 8, 7, 100, 101]]
    refs = [hf_greedy(loaded.model, p, 30) for p in prompts]
    pipe = make_pipeline(loaded, "pld", "max_new_tokens=30", "model.cpu_linear=auto", "strategy.propose.costs=null")
    results = pipe.engine.generate([Request(prompt_ids=p, strategy=s) for p, s in
                                    zip(prompts, ["pld", "baseline", "jacobi"])])
    assert [r.token_ids for r in results] == refs
    assert int8_calls
