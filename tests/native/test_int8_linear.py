"""Weight-only int8 linears (the certified head's and the float32 target's self-draft): the int8 kernel of
small_gemm.c (``mtpflow_small_gemm_q8``) against F.linear over the dequantized weight. The int8 model of
``model.quantize=int8`` (int8 activations too) is tests/kernels/test_int8_model.py's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtpflow.backends.native import kernel, products

needs_native = pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the native kernel")


def _dequantized(w):
    q, scale = products.quantize_int8(w)
    return q, scale, q.float() * scale[:, None]


def test_quantize_int8_round_trip():
    torch.manual_seed(0)
    w = torch.randn(37, 50)
    w[3] = 0.0  # a row of zeros: scale 1, q 0
    q, scale, deq = _dequantized(w)
    assert q.dtype == torch.int8 and scale.shape == (37,) and int(q.abs().max()) <= 127
    assert torch.all((w - deq).abs() <= scale[:, None] / 2 + 1e-7)  # rounding to the nearest step
    assert scale[3] == 1.0 and not q[3].any()
    assert torch.equal(products.quantize_int8(deq)[0], q)  # quantizing the dequantized weight: the same q


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
    got = products.linear_int8(x, q, scale, b)
    torch.testing.assert_close(got, F.linear(x, deq, b), rtol=1e-4, atol=1e-4 * in_f ** 0.5)
    # each row's result does not depend on the other rows of the call (a verify forward's rows are apart)
    alone = torch.cat([products.linear_int8(x[i:i + 1], q, scale, b) for i in range(rows)])
    assert torch.equal(got, alone)


@needs_native
def test_the_avx2_int8_build_matches_f_linear(tmp_path):
    cc = kernel.compiler()
    out = tmp_path / "avx2.so"
    if not kernel.build(cc, out, (*kernel.FLAGS, "-mno-avx512f")):
        pytest.skip("the compiler cannot target AVX2 without AVX-512 here")
    lib = kernel.load(out)
    assert lib.mtpflow_vector_width() == 8
    torch.manual_seed(1)
    for rows in (1, 3, 13):
        for out_f, in_f in ((5, 17), (130, 576)):
            x, w, b = torch.randn(rows, in_f), torch.randn(out_f, in_f), torch.randn(out_f)
            q, scale, deq = _dequantized(w)
            torch.testing.assert_close(products.linear_int8(x, q, scale, b, lib=lib), F.linear(x, deq, b),
                                       rtol=1e-4, atol=1e-4 * in_f ** 0.5)
