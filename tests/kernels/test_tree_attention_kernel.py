"""Tree attention: the flash-decoding Triton kernel against masked softmax attention (random trees, prefix
lengths, head dims, grouped-query heads, key splits), and the ``mtpflow`` HF attention function inside a tiny
Llama: same logits as SDPA for tree verify forwards, same tokens for whole decodes, with either implementation."""
from __future__ import annotations

import random

import pytest
import torch
from kernel_cases import DEVICE, random_parents, tree_allowed

from mtpflow.kernels import tree_attention, tree_attention_reference, use_impl
from mtpflow.kernels.tree_attention_triton import tree_attention_triton


def test_kernel_matches_reference():
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    for case in range(6):
        batch, kv_heads, group = rng.randint(1, 2), rng.choice([1, 2]), rng.choice([1, 3])
        head_dim, nq, prefix = rng.choice([8, 16, 24]), rng.randint(1, 20), rng.choice([0, 1, rng.randint(2, 50)])
        allowed = tree_allowed(random_parents(rng, nq)).expand(batch, -1, -1)
        q = torch.randn(batch, kv_heads * group, nq, head_dim, generator=g)
        k, v = (torch.randn(batch, kv_heads, prefix + nq, head_dim, generator=g) for _ in range(2))
        expected = tree_attention_reference(q, k, v, allowed, prefix)
        qd, kd, vd, ad = (t.to(DEVICE) for t in (q, k, v, allowed))
        torch.testing.assert_close(tree_attention(qd, kd, vd, ad, prefix, impl="triton").cpu(), expected,
                                   atol=1e-4, rtol=1e-4)
        # several key splits merged by log-sum-exp
        split = tree_attention_triton(qd, kd, vd, ad, prefix, head_dim**-0.5, keys_per_split=16)
        torch.testing.assert_close(split.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_reference_is_masked_softmax_attention():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(3))
    allowed = torch.tensor([[[True, False, False], [True, True, False], [True, False, True]]])
    mask = allowed[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(tree_attention_reference(q, k, v, allowed, 0), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_mtpflow_attention():
    """A one-layer tiny Llama (4 heads over 2 KV heads) using attn_implementation="mtpflow" (one layer keeps
    the interpreter's share of the decode test small)."""
    from helpers import tiny_loaded

    from mtpflow.kernels.hf_attention import register

    register()
    loaded = tiny_loaded(seed=3, layers=1)
    loaded.model.set_attn_implementation("mtpflow")
    return loaded


def test_tree_verify_logits_equal_sdpa(tiny_mtpflow_attention):
    from mtpflow.target import Target
    from mtpflow.types import Draft

    model = tiny_mtpflow_attention.model
    prompt = torch.tensor([5, 9, 12, 40, 7, 3, 3, 8])
    tree = Draft(torch.tensor([11, 22, 33, 44, 55, 66]), torch.tensor([-1, -1, 0, 1, 3, 0]))
    results = {}
    for attn, impl in (("sdpa", "torch"), ("mtpflow", "torch"), ("mtpflow", "triton")):
        model.set_attn_implementation(attn)
        with use_impl(impl):
            target = Target(model)
            target.prefill(prompt[:-1])
            chain = target.verify(int(prompt[-1]), Draft.chain([11, 33]), root_position=7).logits
            target.commit(7, 2, torch.tensor([0, 1]))
            tree_logits = target.verify(33, tree, root_position=9).logits
        results[attn, impl] = (chain, tree_logits)
    model.set_attn_implementation("mtpflow")
    for key in (("mtpflow", "torch"), ("mtpflow", "triton")):
        for got, want in zip(results[key], results["sdpa", "torch"]):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_decode_tokens_equal_with_either_impl(tiny_mtpflow_attention):
    from helpers import hf_greedy, make_pipeline

    ids = [5, 9, 12, 5, 9, 12, 40, 7, 5, 9]
    reference = hf_greedy(tiny_mtpflow_attention.model, ids, 16)  # HF generate through the same attention
    for impl in ("torch", "triton"):
        result = make_pipeline(tiny_mtpflow_attention, "pld", "max_new_tokens=16", f"kernels={impl}")(prompt_ids=ids)
        assert result.token_ids == reference, impl
