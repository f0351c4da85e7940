"""The native small-batch linear (mtpflow.kernels.native_linear, small_gemm.c) against its reference, F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import hf_greedy, make_pipeline, tiny_loaded
from mtpflow.kernels import cpu_linear, native_linear

needs_native = pytest.mark.skipif(not native_linear.available(), reason="no C compiler to build the native kernel")


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """native_linear.library() built afresh into an empty cache; the process-wide build is restored after."""
    monkeypatch.setenv("MTPFLOW_CACHE", str(tmp_path))
    native_linear.library.cache_clear()
    yield tmp_path
    native_linear.library.cache_clear()


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 17])
@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (97, 48), (130, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_both_kernels_match_f_linear(rows, shape, bias):
    out_f, in_f = shape
    torch.manual_seed(rows * 1000 + out_f)
    x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f)
    b = torch.randn(out_f) if bias else None
    ref = F.linear(x, w, b)
    tol = dict(rtol=1e-4, atol=1e-4 * in_f ** 0.5)
    torch.testing.assert_close(native_linear.linear(x, w, b), ref, **tol)  # row kernel
    torch.testing.assert_close(native_linear.linear(x, w, b, native_linear.pack_panels(w)), ref, **tol)  # panels


@needs_native
def test_the_avx2_build_matches_f_linear(tmp_path):
    """The 8-float build (CPUs without AVX-512) has its own block sizes and takes 1-2 rows one weight row at a
    time; built here with AVX-512 turned off."""
    cc = native_linear.compiler()
    out = tmp_path / "avx2.so"
    if not native_linear.build(cc, out, (*native_linear.FLAGS, "-mno-avx512f")):
        pytest.skip("the compiler cannot target AVX2 without AVX-512 here")
    lib = native_linear.load(out)
    assert lib.mtpflow_vector_width() == 8  # really the 8-float code path
    torch.manual_seed(0)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 16, 17):  # the one-row path, 3-row tiles, remainders
        for out_f, in_f in ((5, 17), (130, 576), (33, 1544)):
            x, w, b = torch.randn(rows, in_f), torch.randn(out_f, in_f), torch.randn(out_f)
            ref = F.linear(x, w, b)
            tol = dict(rtol=1e-4, atol=1e-4 * in_f ** 0.5)
            torch.testing.assert_close(native_linear.linear(x, w, b, lib=lib), ref, **tol)
            torch.testing.assert_close(native_linear.linear(x, w, b, native_linear.pack_panels(w), lib=lib), ref, **tol)


@needs_native
@pytest.mark.parametrize("avx2", [False, True])
def test_a_rows_panel_product_does_not_depend_on_the_rows_beside_it(tmp_path, avx2):
    """Every panel tile (1-6 rows) sums each output over k in the same order, so a row's product through the
    panel kernel is bit-identical whether it runs alone or among 2-20 rows (other tiles): a sequence's logits
    from the panels do not change with the rows of other sequences verified beside it."""
    lib = native_linear.library()
    if avx2:
        out = tmp_path / "avx2.so"
        if not native_linear.build(native_linear.compiler(), out, (*native_linear.FLAGS, "-mno-avx512f")):
            pytest.skip("the compiler cannot target AVX2 without AVX-512 here")
        lib = native_linear.load(out)
    torch.manual_seed(1)
    w = torch.randn(200, 576)
    panels = native_linear.pack_panels(w)
    x = torch.randn(20, 576)

    def panel_product(rows: torch.Tensor) -> torch.Tensor:
        y = torch.empty(rows.shape[0], w.shape[0])
        lib.mtpflow_panel_gemm(rows.data_ptr(), panels.data_ptr(), None, y.data_ptr(), rows.shape[0], w.shape[0],
                               w.shape[1], torch.get_num_threads())
        return y

    alone = torch.cat([panel_product(x[i:i + 1].contiguous()) for i in range(20)])
    torch.testing.assert_close(alone, F.linear(x, w), rtol=1e-4, atol=1e-3)
    for rows in range(2, 21):
        assert torch.equal(panel_product(x[:rows].contiguous()), alone[:rows]), rows


@needs_native
def test_leading_dims_and_non_contiguous_inputs():
    w, b = torch.randn(40, 32), torch.randn(40)
    x = torch.randn(32, 7).t()[None]  # (1, 7, 32), not contiguous
    assert not x.is_contiguous()
    got = native_linear.linear(x, w, b, native_linear.pack_panels(w))
    assert got.shape == (1, 7, 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_panel_layout():
    w = torch.arange(70 * 3, dtype=torch.float32).reshape(70, 3)
    panels = native_linear.pack_panels(w)
    assert panels.shape == (2, 3, native_linear.PANEL)
    assert torch.equal(panels[1, 2, 5], w[native_linear.PANEL + 5, 2])
    assert torch.equal(panels[0, :, :].t(), w[: native_linear.PANEL])
    assert not panels[1, :, 70 - native_linear.PANEL:].any()  # zero rows past the weight's end


def test_turned_off_or_no_compiler_means_no_native_plan(fresh_library, monkeypatch):
    monkeypatch.setenv("MTPFLOW_NATIVE", "0")
    assert native_linear.library() is None and "native" not in cpu_linear.available_plans()
    native_linear.library.cache_clear()
    monkeypatch.delenv("MTPFLOW_NATIVE")
    monkeypatch.setenv("CC", str(fresh_library / "no-such-compiler"))
    assert not native_linear.available()
    assert cpu_linear.available_plans() == ("stock", "packed", "head")
    layer = torch.nn.Linear(48, 96)
    cpu_linear.install(torch.nn.Sequential(layer), plans=("native",) * len(cpu_linear.ROW_BUCKETS))
    assert set(layer._mtpflow_row_paths) == {"stock"}  # a stored "native" plan runs stock where it cannot build
    x = torch.randn(5, 48)
    with torch.inference_mode(), cpu_linear.packed():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_native
def test_a_damaged_cached_build_is_rebuilt(fresh_library):
    path = native_linear.build_path(native_linear.compiler())
    assert path.parent.parent == fresh_library
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")  # e.g. a build cut short
    assert native_linear.available()
    assert path.read_bytes()[:4] == b"\x7fELF"


@needs_native
def test_native_plan_routes_rows_to_the_right_kernel():
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 96)
    cpu_linear.install(torch.nn.Sequential(layer), plans=("native",) * len(cpu_linear.ROW_BUCKETS))
    assert set(layer._mtpflow_row_paths) == {"native"}
    with torch.inference_mode(), cpu_linear.packed():
        for rows in range(1, native_linear.panel_min_rows()):
            x = torch.randn(1, rows, 48)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert layer._mtpflow_panels is None  # the row kernel needs no copy of the weight
        x = torch.randn(1, 9, 48)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert layer._mtpflow_panels is not None  # from panel_min_rows() rows: the panel kernel
        long = torch.randn(1, 40, 48)  # past the largest row bucket (a prefill): stock
        assert torch.equal(layer(long), F.linear(long, layer.weight, layer.bias))
        with torch.no_grad():
            layer.weight.mul_(2.0)  # panels follow the weight
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("strategy,k", [("pld", 8), ("jacobi", 5)])
def test_decode_is_lossless_with_native_linears(strategy, k):
    loaded = tiny_loaded(seed=5)
    ids = list(range(7, 27)) * 2
    ref = hf_greedy(loaded.model, ids, 40)
    cpu_linear.install(loaded.model, plans=("native",) * len(cpu_linear.ROW_BUCKETS))
    overrides = ["strategy.propose.costs=null"] if strategy == "pld" else []
    pipe = make_pipeline(loaded, strategy, "max_new_tokens=40", "model.cpu_linear=auto",
                         f"strategy.select_k.k={k}", *overrides)
    with cpu_linear.packed():
        assert "[" + ",".join(["native"] * len(cpu_linear.ROW_BUCKETS)) + "] native:" in cpu_linear.state(loaded.model)
    assert pipe(prompt_ids=ids).token_ids == ref
    assert hf_greedy(loaded.model, ids, 40) == ref  # HF generate on the same model object stays stock
