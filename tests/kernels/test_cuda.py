"""CUDA-only checks (skipped without a GPU): the ``mtpflow`` attention on a tiny Llama on the GPU against
SDPA, and whole decodes on the GPU giving the same tokens with ``kernels=torch`` and ``kernels=triton``
(compiled kernels in the gate, the attention and, for trees, the tree attention kernel)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny_cuda():
    from helpers import tiny_loaded

    from mtpflow.kernels.hf_attention import register
    from mtpflow.model import LoadedModel

    register()
    cpu = tiny_loaded(seed=5)
    model = cpu.model.to("cuda")
    return LoadedModel(model, cpu.tokenizer, cpu.model_id, torch.device("cuda"), torch.float32, 1024, (0,))


def test_tree_and_chain_logits_match_sdpa_on_cuda(tiny_cuda):
    from mtpflow.kernels import use_impl
    from mtpflow.target import Target
    from mtpflow.types import Draft

    model = tiny_cuda.model
    prompt = torch.arange(3, 40)
    tree = Draft(torch.tensor([11, 22, 33, 44, 55, 66]), torch.tensor([-1, -1, 0, 1, 3, 0]))
    results = {}
    for attn, impl in (("sdpa", "torch"), ("mtpflow", "triton")):
        model.set_attn_implementation(attn)
        with use_impl(impl):
            target = Target(model)
            target.prefill(prompt[:-1])
            chain = target.verify(int(prompt[-1]), Draft.chain([11, 33]), root_position=36).logits
            target.commit(36, 2, torch.tensor([0, 1]))
            results[attn] = (chain, target.verify(33, tree, root_position=38).logits)
    for got, want in zip(results["mtpflow"], results["sdpa"]):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_auto_takes_the_hf_backend_on_cuda_and_native_cpu_is_one_line(tiny_cuda):
    from mtpflow import backends
    from mtpflow.errors import UserError

    tiny_cuda.model.set_attn_implementation("sdpa")
    assert backends.create(tiny_cuda.model, "auto").name == "hf"
    with pytest.raises(UserError, match="model.backend=native_cpu does not apply here: it runs on the CPU and the "
                                        "model is on cuda"):
        backends.create(tiny_cuda.model, "native_cpu")


@pytest.mark.parametrize("attn", ["sdpa", "mtpflow"])
def test_decode_tokens_identical_on_cuda(tiny_cuda, attn):
    from helpers import make_pipeline

    tiny_cuda.model.set_attn_implementation(attn)
    ids = [5, 9, 12, 40, 5, 9, 12, 7, 5, 9] * 3
    out = {}
    for b in ("torch", "triton"):
        pipe = make_pipeline(tiny_cuda, "pld", "max_new_tokens=32", f"kernels={b}")
        assert pipe.engine.backend.name == "hf"  # model.backend=auto: native_cpu does not apply on CUDA
        out[b] = pipe(prompt_ids=ids).token_ids
    assert out["torch"] == out["triton"]


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed")
def test_flash_attn_path_matches_sdpa_in_bf16():
    from mtpflow.kernels.hf_attention import mtpflow_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 5, 64, generator=g).cuda().bfloat16()
    k, v = (torch.randn(1, 2, 40, 64, generator=g).cuda().bfloat16() for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    from mtpflow.kernels import use_impl

    with use_impl("triton"):
        got, _ = mtpflow_attention(module, q, k, v, None)
    with use_impl("torch"):
        want, _ = mtpflow_attention(module, q, k, v, None)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
