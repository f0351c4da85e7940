"""The oneDNN packed linears of the CPU verify forward (mtpflow.kernels.cpu_linear)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import count_runs, hf_greedy, make_pipeline, make_tiny_model, tiny_loaded
from mtpflow.errors import ConfigError
from mtpflow.kernels import cpu_linear, native_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear ops")


def packed_layer(i=48, o=96, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(i, o, bias=bias)
    assert cpu_linear.install(torch.nn.Sequential(layer)) == 1
    return layer


@pytest.mark.parametrize("rows", [2, 3, 5, 17])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_matches_f_linear(rows, bias):
    layer = packed_layer(bias=bias)
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        ref = F.linear(x, layer.weight, layer.bias)
        with cpu_linear.packed():
            got = layer(x)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert layer._mtpflow_pack is not None  # the oneDNN path really ran


def test_stock_outside_the_context_one_row_and_with_grad():
    layer = packed_layer()
    x = torch.randn(4, 48)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # no packed() block: stock
        with cpu_linear.packed():
            one = torch.randn(1, 1, 48)
            assert torch.equal(layer(one), F.linear(one, layer.weight, layer.bias))  # one row: stock MKL
    assert layer._mtpflow_pack is None
    with cpu_linear.packed():  # autograd needs the stock op
        y = layer(torch.randn(3, 48, requires_grad=True))
        y.sum().backward()
    assert layer.weight.grad is not None and layer._mtpflow_pack is None


def test_repacks_when_the_weight_changes():
    layer = packed_layer()
    x = torch.randn(3, 48)
    with torch.inference_mode(), cpu_linear.packed():
        layer(x)
        with torch.no_grad():
            layer.weight.mul_(2.0)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_install_keeps_modules_tied_and_isinstance():
    model = make_tiny_model(64, layers=1)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    n = cpu_linear.install(model)
    assert n == sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear)) and n > 0
    assert cpu_linear.install(model) == 0  # idempotent
    assert isinstance(model.lm_head, torch.nn.Linear) and type(model.lm_head) is cpu_linear.PackedLinear
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_should_pack_rules(monkeypatch):
    model = make_tiny_model(64, layers=1)
    assert cpu_linear.should_pack("auto", model) and cpu_linear.should_pack("packed", model)
    assert not cpu_linear.should_pack("stock", model)
    monkeypatch.setattr(cpu_linear, "AUTO_MAX_BYTES", 10)
    assert not cpu_linear.should_pack("auto", model) and cpu_linear.should_pack("packed", model)
    assert not cpu_linear.should_pack("packed", model.to(torch.bfloat16))
    with pytest.raises(ConfigError, match="model.cpu_linear must be one of"):
        cpu_linear.check_mode("fast")


def test_decode_is_lossless_with_packed_and_stock_linears():
    loaded = tiny_loaded(seed=3)
    ids = list(range(5, 25)) * 2
    ref = hf_greedy(loaded.model, ids, 40)
    for mode in ("auto", "stock"):
        pipe = make_pipeline(loaded, "pld", "max_new_tokens=40", f"model.cpu_linear={mode}",
                             "strategy.propose.costs=null")
        assert pipe.packed_linear == (mode == "auto")
        assert pipe(prompt_ids=ids).token_ids == ref
    # HF generate on the same (now installed) model object is still stock
    assert hf_greedy(loaded.model, ids, 40) == ref


def test_bad_mode_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match="cpu_linear"):
        make_pipeline(tiny, "pld", "model.cpu_linear=fast")


def test_one_row_transposed_path_and_its_timing_choice():
    layer = packed_layer()
    layer._mtpflow_one_row_transposed = True  # what install picks where the transposed product is faster
    one = torch.randn(1, 1, 48)
    with torch.inference_mode(), cpu_linear.packed():
        torch.testing.assert_close(layer(one), F.linear(one, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert layer._mtpflow_t is not None
    small = torch.nn.Linear(48, 96)
    assert cpu_linear.one_row_transposed_is_faster(small) is False  # cache-resident: never timed


@pytest.mark.parametrize("faster", [True, False])
def test_install_applies_the_timed_one_row_choice_to_every_layer(monkeypatch, faster):
    timed = []
    monkeypatch.setattr(cpu_linear, "one_row_transposed_is_faster", lambda layer: timed.append(layer) or faster)
    model = make_tiny_model(64, layers=2)
    cpu_linear.install(model)
    assert timed == [max((m for m in model.modules() if isinstance(m, torch.nn.Linear)),
                         key=lambda m: m.weight.numel())]  # timed once, on the largest layer
    layers = [m for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert layers and all(m._mtpflow_one_row_transposed is faster for m in layers)
    with cpu_linear.packed():
        assert cpu_linear.state(model) == ("packed+t1" if faster else "packed")
    assert cpu_linear.state(model) == "stock"  # outside a run


def test_multi_row_plans_pick_the_path_per_row_count():
    model = make_tiny_model(64, layers=1)
    cpu_linear.install(model, plans=("native", "stock", "head", "packed", "packed", "packed", "native"))
    layers = [m for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    largest = max(layers, key=lambda m: m.weight.numel())
    x2, x3 = torch.randn(1, 2, largest.in_features), torch.randn(1, 3, largest.in_features)
    with torch.inference_mode(), cpu_linear.packed():
        assert torch.equal(largest(x2), F.linear(x2, largest.weight, largest.bias))  # 2 rows: stock
        assert largest._mtpflow_pack is None
        torch.testing.assert_close(largest(x3), F.linear(x3, largest.weight, largest.bias), rtol=1e-5, atol=1e-5)
        assert largest._mtpflow_pack is not None  # 3 rows, "head": the largest layer packs...
        other = next(m for m in layers if m is not largest)
        other(torch.randn(1, 3, other.in_features))
        assert other._mtpflow_pack is None  # ...and the others stay stock
        assert "[native,stock,head,packed,packed,packed,native]" in cpu_linear.state(model)
        if native_linear.available():  # one row, "native": the native kernel (no transposed copy)
            x1 = torch.randn(1, 1, largest.in_features)
            torch.testing.assert_close(largest(x1), F.linear(x1, largest.weight, largest.bias), rtol=1e-5, atol=1e-5)
            assert largest._mtpflow_t is None
            # a prompt's prefill (beyond 17 rows) follows the last bucket's plan: native here, not MKL
            x40 = torch.randn(1, 40, largest.in_features)
            torch.testing.assert_close(largest(x40), F.linear(x40, largest.weight, largest.bias), rtol=1e-5, atol=1e-5)
            assert largest._mtpflow_panels is not None
    assert [cpu_linear.bucket(r) for r in (1, 2, 3, 4, 5, 9, 10, 17, 18, 64, 300)] == [0, 1, 2, 3, 3, 4, 5, 5, 6, 6, 6]
    with pytest.raises(ValueError, match="plans"):
        cpu_linear.apply_plans(model, ("fast",) * 7)


def test_plans_are_timed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPFLOW_CACHE", str(tmp_path))
    model = make_tiny_model(64, layers=1)
    cpu_linear.install(model, plans=cpu_linear.DEFAULT_PLANS)
    monkeypatch.setattr(cpu_linear, "linear_bytes", lambda m: 1 << 30)  # as if big enough to time
    monkeypatch.setattr(cpu_linear.os, "getloadavg", lambda: (0.5, 0.5, 0.5))  # a quiet CPU: the timing is kept
    fake = {(r, p): [v, v] for r in cpu_linear.ROW_BUCKETS
            for p, v in {"stock": 1.0, "packed": 2.0, "head": 0.5 if r > 3 else 3.0}.items()}
    calls = []
    monkeypatch.setattr(cpu_linear, "time_plans", lambda m: calls.append(m) or fake)
    expected = ("stock", "stock", "stock", "head", "head", "head", "head")
    assert cpu_linear.load_plans(model) == expected and len(calls) == 1
    assert cpu_linear.load_plans(model) == expected and len(calls) == 1  # cached on disk
    (cached,) = (tmp_path / "cpu_linear").glob("*.json")
    cached.write_text("{not json")
    assert cpu_linear.load_plans(model) == expected and len(calls) == 2  # a damaged cache is timed again


def test_time_plans_runs_every_plan_and_restores_the_model():
    model = make_tiny_model(64, layers=1)
    cpu_linear.install(model, plans=("stock",) * 7)
    timed = cpu_linear.time_plans(model, repeats=2)
    assert set(timed) == {(r, p) for r in cpu_linear.ROW_BUCKETS for p in cpu_linear.available_plans()}
    assert all(len(v) == 2 and min(v) > 0 for v in timed.values())  # every repeat after the warm-up round
    assert model._mtpflow_linear_plans == ("stock",) * 7
    layers = [m for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert all(m._mtpflow_pack is None and m._mtpflow_panels is None for m in layers)  # timing copies freed
    cpu_linear.apply_plans(model, ("packed",) * 7)
    cpu_linear.time_plans(model, repeats=1)
    # in use (the timing ran the lean forward, which fuses q/k/v and gate/up): the packed copies are kept; the
    # transposed one-row copy is for the stock path only
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for m in (model.lm_head, attn.o_proj, mlp.down_proj, attn.__dict__["_mtpflow_qkv"], mlp.__dict__["_mtpflow_gate_up"]):
        assert m._mtpflow_pack is not None and m._mtpflow_panels is None and m._mtpflow_t is None


def test_a_model_whose_forward_cannot_be_timed_keeps_the_default_plans(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPFLOW_CACHE", str(tmp_path))
    model = make_tiny_model(64, layers=1)
    cpu_linear.install(model, plans=cpu_linear.DEFAULT_PLANS)
    monkeypatch.setattr(cpu_linear, "linear_bytes", lambda m: 1 << 30)

    def fails(m):
        raise TypeError("forward() missing 1 required positional argument: 'pixel_values'")

    monkeypatch.setattr(cpu_linear, "time_plans", fails)
    assert cpu_linear.load_plans(model) == cpu_linear.DEFAULT_PLANS
    assert not (tmp_path / "cpu_linear").exists()  # nothing cached: a later load tries again


def test_the_one_row_choice_is_timed_only_where_one_row_takes_the_stock_path(monkeypatch):
    timed = []
    monkeypatch.setattr(cpu_linear, "one_row_transposed_is_faster", lambda layer: timed.append(layer) or True)
    model = make_tiny_model(64, layers=2)
    cpu_linear.install(model, plans=("native",) * len(cpu_linear.ROW_BUCKETS))
    assert timed == [] or not native_linear.available()  # one row native: nothing to choose
    cpu_linear.apply_plans(model, cpu_linear.DEFAULT_PLANS)  # one row stock: timed now, once
    cpu_linear.apply_plans(model, cpu_linear.DEFAULT_PLANS)
    assert len(timed) == 1
    assert all(m._mtpflow_one_row_transposed for m in model.modules() if type(m) is cpu_linear.PackedLinear)


def test_plans_are_timed_through_the_forward_decoding_runs(monkeypatch):
    """The native plan's verify buckets run every layer in one native call where the model allows it (what a
    verify does), so the timing sees what that saves; the prefill bucket runs the lean forward, last row only."""
    from mtpflow import forward

    if not native_linear.available():
        pytest.skip("the native kernel cannot be built here")
    model = make_tiny_model(64, layers=2)
    cpu_linear.install(model, plans=cpu_linear.DEFAULT_PLANS)
    natives = count_runs(monkeypatch, forward, "native_rows")
    kept = []
    real_run = forward.run
    monkeypatch.setattr(forward, "run", lambda *a, **k: kept.append(k.get("logits_to_keep")) or real_run(*a, **k))
    cpu_linear.time_plans(model, repeats=1)
    verify_buckets = [r for r in cpu_linear.ROW_BUCKETS if r < cpu_linear.ROW_BUCKETS[-1]]
    assert len(natives) >= len(verify_buckets)  # the native plan, after the warm-up round fused the model
    assert {m for (logits, _, _) in natives for m in [logits.shape[0]]} <= set(verify_buckets)
    assert 1 in kept  # prefills keep the last row's logits only
