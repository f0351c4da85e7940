"""Each verify row's argmax, log-normalizer and top ids in one native pass (``kernel.logit_stats``, logit_stats.c):
torch's argmax exactly (first index among ties, a NaN the largest), torch's logsumexp to float rounding, the ids of
torch.topk's values (largest first, the lower id first among equals); the native backends hand them to every
Verification, which the gate, the loop and token recycling read."""
from __future__ import annotations

import ctypes

import pytest
import torch

from helpers import make_tiny_model
from mtpflow.backends.native import cpu as native_cpu
from mtpflow.backends.native import kernel
from mtpflow.target import Target
from mtpflow.types import Draft

pytestmark = pytest.mark.skipif(not kernel.available(), reason="the native CPU kernels could not be built")


def logits_cases():
    g = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 49152), (13, 4099), (3, 7), (2, 17), (1, 1), (4, 33), (9, 1000)]:
        x = torch.randn(rows, vocab, generator=g) * 4
        yield f"{rows}x{vocab}", x
        yield f"{rows}x{vocab} ties", x.round()  # many equal maxima: the first index wins
        flat = x.clone()
        flat[-1] = 3.0
        yield f"{rows}x{vocab} flat row", flat
        special = x.clone()
        special[0] = -float("inf")
        if rows > 1:
            special[1, vocab // 2] = float("nan")
        if rows > 2:
            special[2, vocab - 1] = float("inf")
        yield f"{rows}x{vocab} inf nan", special


@pytest.fixture(scope="module", params=kernel.runnable_isas())
def isa_build(request, tmp_path_factory):
    """logit_stats.c alone, built for each instruction set this CPU runs (16-float vectors with AVX-512, 8 without)."""
    out = tmp_path_factory.mktemp(request.param) / f"{request.param}.so"
    assert kernel.build_variant(request.param, out, sources=(kernel.HERE / "logit_stats.c",))
    return ctypes.CDLL(str(out))


def check_top_ids(x: torch.Tensor, top_ids: torch.Tensor, k: int, name: str) -> None:
    """top_ids are torch.topk's values, largest first, and among equal values the lower ids"""
    values = x.gather(1, top_ids)
    assert torch.equal(values, x.topk(k, dim=-1).values), name
    for row, ids, vals in zip(x, top_ids, values):
        for v in vals.unique():  # the ids of an equal value: the lowest ids that hold it, in order
            mine = ids[vals == v]
            assert torch.equal(mine, (row == v).nonzero().flatten()[:mine.numel()]), name


@pytest.mark.parametrize("threads", [1, 2])
def test_equals_torch_argmax_logsumexp_and_topk(threads, isa_build):
    for name, x in logits_cases():
        k = min(8, x.shape[1])
        argmax, log_norm, top_ids = kernel.logit_stats(x, threads, lib=isa_build, top=k)
        assert torch.equal(argmax, x.argmax(-1)), name
        torch.testing.assert_close(log_norm, torch.logsumexp(x, -1), rtol=2e-6, atol=2e-6, equal_nan=True,
                                   msg=name)
        if bool(x.isnan().any()):
            assert top_ids is None, name  # a row with a NaN: its top ids are torch's to give (Verification.top_ids)
        else:
            check_top_ids(x, top_ids, k, name)
            if "ties" not in name and "flat" not in name and "inf" not in name:  # distinct values: torch's own ids
                assert torch.equal(top_ids, x.topk(k, dim=-1).indices), name
        assert kernel.logit_stats(x, threads, lib=isa_build)[2] is None  # none asked for


def test_strided_rows_and_what_it_declines():
    x = torch.randn(16, 3000)[::2]  # rows 6000 floats apart
    argmax, log_norm, top_ids = kernel.logit_stats(x, 2, top=16)
    assert torch.equal(argmax, x.argmax(-1))
    torch.testing.assert_close(log_norm, torch.logsumexp(x, -1))
    assert torch.equal(top_ids, x.topk(16, dim=-1).indices)
    assert kernel.logit_stats(x, 2, top=40)[2].shape == (8, kernel.TOP_IDS_MAX)  # at most TOP_IDS_MAX
    assert kernel.logit_stats(torch.randn(2, 3), 2, top=8)[2].shape == (2, 3)  # at most the vocabulary
    assert kernel.logit_stats(x.double(), 2) is None  # only float32
    assert kernel.logit_stats(x.t(), 2) is None  # rows must be contiguous
    assert kernel.logit_stats(torch.zeros(3, 0), 2) is None


def test_native_verification_carries_them():
    """A native verify's Verification comes with both already computed, equal to torch's over its logits."""
    model = make_tiny_model(96, layers=2)
    with torch.inference_mode():
        target = Target(native_cpu.NativeCPUBackend(model))
        target.prefill(torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(0)))
        draft = Draft(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 2]))
        v = target.verify(1, draft, root_position=target.cache_len)
    assert {"_target_argmax", "_log_norm", "_top_ids"} <= set(v.__dict__)  # handed over, not computed on demand
    assert torch.equal(v.target_argmax(), v.logits.argmax(-1))
    torch.testing.assert_close(v.log_norm(), torch.logsumexp(v.logits, -1))
    assert torch.equal(v.top_ids(4), v.logits.topk(4, dim=-1).indices)
    assert torch.equal(v.top_ids(20), v.logits.topk(20, dim=-1).indices)  # more than it came with: torch's
