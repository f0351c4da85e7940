"""The native small-batch linear (mtpflow.kernels.native_linear, small_gemm.c) against its reference, F.linear, and
the ``native_cpu`` backend's products over it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import hf_greedy, make_pipeline, make_tiny_model, tiny_loaded
from mtpflow import backends
from mtpflow.backends.native import cpu as native_cpu
from mtpflow.errors import UserError
from mtpflow.backends.native import kernel, products

needs_native = pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the native kernel")


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """kernel.library() built afresh into an empty cache; the process-wide build is restored after."""
    monkeypatch.setenv("MTPFLOW_CACHE", str(tmp_path))
    kernel.library.cache_clear()
    yield tmp_path
    kernel.library.cache_clear()


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
    torch.testing.assert_close(products.linear(x, w, b), ref, **tol)  # row kernel
    torch.testing.assert_close(products.linear(x, w, b, products.pack_panels(w)), ref, **tol)  # panels


@needs_native
def test_the_avx2_build_matches_f_linear(tmp_path):
    """The 8-float build (CPUs without AVX-512) has its own block sizes and takes 1-2 rows one weight row at a
    time; built here with AVX-512 turned off."""
    cc = kernel.compiler()
    out = tmp_path / "avx2.so"
    if not kernel.build(cc, out, (*kernel.FLAGS, "-mno-avx512f")):
        pytest.skip("the compiler cannot target AVX2 without AVX-512 here")
    lib = kernel.load(out)
    assert lib.mtpflow_vector_width() == 8  # really the 8-float code path
    torch.manual_seed(0)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 16, 17):  # the one-row path, 3-row tiles, remainders
        for out_f, in_f in ((5, 17), (130, 576), (33, 1544)):
            x, w, b = torch.randn(rows, in_f), torch.randn(out_f, in_f), torch.randn(out_f)
            ref = F.linear(x, w, b)
            tol = dict(rtol=1e-4, atol=1e-4 * in_f ** 0.5)
            torch.testing.assert_close(products.linear(x, w, b, lib=lib), ref, **tol)
            torch.testing.assert_close(products.linear(x, w, b, products.pack_panels(w), lib=lib), ref, **tol)


@needs_native
@pytest.mark.parametrize("avx2", [False, True])
def test_a_rows_panel_product_does_not_depend_on_the_rows_beside_it(tmp_path, avx2):
    """Every panel tile (1-6 rows) sums each output over k in the same order, so a row's product through the
    panel kernel is bit-identical whether it runs alone or among 2-20 rows (other tiles): a sequence's logits
    from the panels do not change with the rows of other sequences verified beside it."""
    lib = kernel.library()
    if avx2:
        out = tmp_path / "avx2.so"
        if not kernel.build(kernel.compiler(), out, (*kernel.FLAGS, "-mno-avx512f")):
            pytest.skip("the compiler cannot target AVX2 without AVX-512 here")
        lib = kernel.load(out)
    torch.manual_seed(1)
    w = torch.randn(200, 576)
    panels = products.pack_panels(w)
    x = torch.randn(20, 576)

    def panel_product(rows: torch.Tensor) -> torch.Tensor:
        y = torch.empty(rows.shape[0], w.shape[0])
        assert kernel.call(lib, "linear", kind=products.PANELS, M=rows.shape[0], N=w.shape[0], K=w.shape[1],
                           threads=torch.get_num_threads(), x=rows.data_ptr(), panels=panels.data_ptr(),
                           y=y.data_ptr()) == 0
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
    got = products.linear(x, w, b, products.pack_panels(w))
    assert got.shape == (1, 7, 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_panel_layout():
    w = torch.arange(70 * 3, dtype=torch.float32).reshape(70, 3)
    q = (torch.arange(70 * 3) % 255 - 127).to(torch.int8).reshape(70, 3)
    for weight, panels in ((w, products.pack_panels(w)), (q, products.pack_q8_panels(q))):
        count = -(-70 // products.PANEL)
        assert panels.shape == (count, 3, products.PANEL) and panels.dtype == weight.dtype
        assert torch.equal(panels[1, 2, 5], weight[products.PANEL + 5, 2])
        assert torch.equal(panels[0, :, :].t(), weight[: products.PANEL])
        assert not panels[-1, :, 70 - (count - 1) * products.PANEL:].any()  # zero rows past the weight's end


def test_no_compiler_means_no_native_backend(fresh_library, monkeypatch, capsys):
    """Without the kernels the native_cpu backend does not apply: ``auto`` runs ``hf`` and says why once, an
    explicit ``native_cpu`` is one line."""
    model = make_tiny_model(64, layers=1)
    monkeypatch.setenv("CC", str(fresh_library / "no-such-compiler"))
    assert kernel.library() is None and not kernel.available()
    assert "C kernel could not be built" in native_cpu.not_applicable(model)
    assert backends.create(model).name == "hf"
    assert backends.create(model).name == "hf"
    said = capsys.readouterr().err.splitlines()
    assert len([line for line in said if "C kernel could not be built" in line]) == 1, said
    assert said[-1].startswith("mtpflow: model.backend=auto runs hf (PyTorch): the native_cpu backend does not apply")
    with pytest.raises(UserError, match="model.backend=native_cpu does not apply here: mtpflow's C kernel"):
        backends.create(model, backends.ExecutionSpec(backend="native_cpu"))


@needs_native
def test_a_damaged_cached_build_is_rebuilt(fresh_library):
    path = kernel.build_path(kernel.compiler())
    assert path.parent.parent == fresh_library
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")  # e.g. a build cut short
    assert kernel.available()
    assert path.read_bytes()[:4] == b"\x7fELF"


@needs_native
def test_the_backend_routes_rows_to_the_right_kernel(monkeypatch):
    """A native_cpu product: the row kernel (no copy of the weight) below ``panel_min_rows()`` rows, the panel
    kernel over the backend's panel copy from there on, a prompt's many rows included; the copy follows an
    in-place change of the weight."""
    torch.manual_seed(0)
    backend = native_cpu.NativeCPUBackend(make_tiny_model(96, layers=1))
    layer = backend.model.model.layers[0].mlp.down_proj
    calls = []
    real = kernel.call
    kinds = {products.F32: "rows", products.PANELS: "panels"}
    monkeypatch.setattr(kernel, "call", lambda lib, entry, **m: calls.append(kinds[m["kind"]]) or real(lib, entry, **m))
    with torch.inference_mode():
        for rows in range(1, kernel.panel_min_rows(backend.lib)):
            x = torch.randn(1, rows, layer.in_features)
            torch.testing.assert_close(backend.module(layer, x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        assert set(calls) <= {"rows"} and not backend._panels  # the row kernel needs no copy
        for rows in (9, 40):  # a verify's rows, a prompt's
            calls.clear()
            x = torch.randn(1, rows, layer.in_features)
            torch.testing.assert_close(backend.module(layer, x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
            assert calls == ["panels"] and layer.weight.data_ptr() in backend._panels
        with torch.no_grad():
            layer.weight.mul_(2.0)  # panels follow the weight
        torch.testing.assert_close(backend.module(layer, x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("strategy,k", [("pld", 8), ("jacobi", 5)])
def test_decode_is_lossless_with_native_linears(strategy, k):
    loaded = tiny_loaded(seed=5)
    ids = list(range(7, 27)) * 2
    ref = hf_greedy(loaded.model, ids, 40)
    overrides = ["strategy.propose.costs=null"] if strategy == "pld" else []
    pipe = make_pipeline(loaded, strategy, "max_new_tokens=40", "model.backend=auto",
                         f"strategy.select_k.k={k}", *overrides)
    assert pipe.engine.backend.name == "native_cpu"
    assert pipe(prompt_ids=ids).token_ids == ref
    assert hf_greedy(loaded.model, ids, 40) == ref  # HF generate on the same model object: still its own forward
