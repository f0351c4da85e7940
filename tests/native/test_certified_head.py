"""The certified LM head (mtpflow.kernels.certified_head): int8 logits with a rigorous bound, exact float32 logits
for every token that could be a row's argmax; which sequences take it (``NativeCPUBackend.head_logits``); greedy
decoding through it equals HF."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import hf_greedy, make_pipeline, make_tiny_model
from mtpflow import backends
from mtpflow.backends import quantize_int8
from mtpflow.backends.native import cpu as native_cpu
from mtpflow.backends import ExecutionSpec
from mtpflow.errors import ConfigError
from mtpflow.backends.native import certified_head, kernel, products

pytestmark = pytest.mark.skipif(not kernel.available(), reason="the native CPU kernels could not be built")


def head(vocab=512, hidden=64, seed=0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(hidden, vocab, bias=False)
    return layer.requires_grad_(False)


@pytest.mark.parametrize("rows", [1, 3, 9, 24])
def test_argmax_exact_and_every_entry_within_its_bound(rows):
    layer = head()
    cert = certified_head.CertifiedHead(layer.weight)
    x = torch.randn(rows, 64) * 3
    exact = F.linear(x, layer.weight)
    got = cert.logits(x)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    bound = (x.norm(dim=1, keepdim=True) * cert.residual_norm
             + certified_head.ROUNDING * x.abs().sum(1, keepdim=True) * cert.abs_max)
    assert bool(((got - exact).abs() <= bound).all())
    top = exact.argmax(-1)
    torch.testing.assert_close(got[torch.arange(rows), top], exact[torch.arange(rows), top], rtol=1e-6, atol=1e-6)
    assert cert.nbytes == 512 * 64 + 3 * 4 * 512  # int8 weight, scale, residual norm, max |w| per token


def test_a_near_tie_is_decided_by_the_float32_logits():
    """Two tokens whose float32 logits differ by 1e-5 (int8 cannot tell them apart): both are candidates, and the
    float32 values pick the winner, whichever of the two it is."""
    layer = head(vocab=256, hidden=32, seed=1)
    x = torch.randn(1, 32)
    w = layer.weight
    w[3] = x[0] / x[0].norm() * 4  # token 3 leads by far
    for sign in (1.0, -1.0):
        w[7] = w[3] + sign * 1e-5 * x[0] / x[0].norm() ** 2  # token 7's logit: token 3's + sign * 1e-5
        exact = F.linear(x, w)
        assert abs(float(exact[0, 7] - exact[0, 3]) - sign * 1e-5) < 5e-6
        cert = certified_head.CertifiedHead(w)
        assert int(cert.logits(x).argmax()) == int(exact.argmax()) == (7 if sign > 0 else 3)


def test_rebuilt_when_the_weight_changes_in_place():
    backend = native_cpu.NativeCPUBackend(make_tiny_model(512, layers=1))
    model = backend.model
    x = torch.randn(2, 64)
    first = backend.head_logits(x, argmax_only=True)
    kept = backend._head
    assert isinstance(kept, certified_head.CertifiedHead)
    backend.head_logits(x, argmax_only=True)
    assert backend._head is kept  # the same weight: built once
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    again = backend.head_logits(x, argmax_only=True)
    assert backend._head is not kept
    assert torch.equal(again.argmax(-1), F.linear(x, model.lm_head.weight).argmax(-1))
    assert not torch.equal(first.argmax(-1), again.argmax(-1))


def test_what_it_declines(monkeypatch):
    layer = head()
    assert certified_head.applies(layer, 1) and certified_head.applies(layer, certified_head.MAX_ROWS)
    assert not certified_head.applies(layer, certified_head.MAX_ROWS + 1)  # wide: the float32 head is as fast
    assert not certified_head.applies(torch.nn.Linear(64, 512), 1)  # a bias
    assert not certified_head.applies(head().to(torch.bfloat16), 1)
    calls = []
    real = certified_head.CertifiedHead.logits
    monkeypatch.setattr(certified_head.CertifiedHead, "logits",
                        lambda self, x, cap=0.0: calls.append(1) or real(self, x, cap))
    backend = native_cpu.NativeCPUBackend(make_tiny_model(512, layers=1))
    wide = torch.randn(certified_head.MAX_ROWS + 1, 64)
    # too many rows, or a reader of the whole distribution: the native float32 head itself
    for x, argmax_only in ((wide, True), (wide[:3], False)):
        got = backend.head_logits(x, argmax_only)
        assert torch.equal(got, backend.module(backend.model.lm_head, x))
        torch.testing.assert_close(got, backend.model.lm_head(x), rtol=1e-5, atol=1e-5)
    assert not calls
    backend.head_logits(wide[:3], True)
    assert calls  # the same backend takes it where it applies
    calls.clear()
    # model.quantize=int8: the int8 model's own int8 head, never the certified one
    model = make_tiny_model(512, layers=1)
    quantized = backends.create(model, "auto", int8=quantize_int8(model))
    assert not quantized.takes_argmax_only()
    x = torch.randn(3, 64)
    # model.certified_head=false
    off = native_cpu.NativeCPUBackend(make_tiny_model(512, layers=1), certified_head=False)
    assert not off.takes_argmax_only()
    off.head_logits(x, True)
    assert not calls
    assert ExecutionSpec.from_config({}).certified_head
    assert not ExecutionSpec.from_config({"model": {"certified_head": False}}).certified_head
    with pytest.raises(ConfigError, match="model.certified_head must be true or false"):
        ExecutionSpec.from_config({"model": {"certified_head": "yes"}})


def test_only_greedy_argmax_readers_take_it(tiny, monkeypatch):
    """Greedy runs whose gate and re-scorer read only the argmax take the certified head and decode as HF greedy;
    sampling, a gate that reads probabilities, a re-scorer and model.certified_head=false take the float32 head."""
    prompt = [5, 17, 23, 8, 42, 11, 9]
    calls = []
    real = certified_head.CertifiedHead.logits
    monkeypatch.setattr(certified_head.CertifiedHead, "logits",
                        lambda self, x, cap=0.0: calls.append(1) or real(self, x, cap))
    seen = []
    real_rows = native_cpu._RowSpec.run_groups
    monkeypatch.setattr(native_cpu._RowSpec, "run_groups",
                        lambda *a, **k: seen.append(k.get("argmax_only")) or real_rows(*a, **k))

    def run(strategy, *overrides):
        calls.clear()
        seen.clear()
        pipe = make_pipeline(tiny, strategy, "max_new_tokens=24", "trace=off", "model.backend=native_cpu",
                             *overrides)
        return pipe, pipe(prompt_ids=prompt).token_ids

    for strategy in ("baseline", "pld", "mtp"):
        pipe, tokens = run(strategy)
        assert tokens == hf_greedy(pipe.loaded.model, prompt, 24)
        assert calls and seen and all(seen), strategy
    for strategy, overrides in [("sampling", ()), ("typical", ()), ("domain_aware", ()),
                                ("pld", ("model.certified_head=false",))]:
        run(strategy, *overrides)
        assert seen and not any(seen) and not calls, strategy
