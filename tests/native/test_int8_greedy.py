"""The int8 model's native greedy loop (``NativeInt8Backend.greedy``, ``mtpflow_w8a8_greedy``): the tokens a self-draft
drafts in one native call are the int8 reference's greedy continuation and those of one ``run`` per token, for every
family the native description knows (an untied float embedding table, a tied int8 head times an embedding scale,
sliding windows, partial and per-layer rotary tables; Gemma 2's soft-capped logits take the per-token path), over all
layers and the first few."""
from __future__ import annotations

import pytest
import torch

from families import FAMILIES, make_family_model
from mtpflow import backends
from mtpflow.backends.native import kernel
from mtpflow.target import Target

pytestmark = pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the native kernel")

STEPS = 10


@pytest.mark.parametrize("family", FAMILIES)
def test_the_native_greedy_loop_is_the_int8_models_greedy(family):
    model = make_family_model(family, 96)
    weights = backends.quantize_int8(model)
    backend = backends.create(model, "native_cpu", int8=weights)
    prompt = torch.tensor([5, 17, 23, 8, 42, 11, 9, 33, 61, 2, 70, 14, 88, 3, 19, 40])  # past the window (12)
    want = backends.int8_reference(weights).greedy(prompt, STEPS)
    target = Target(backend)
    target.prefill(prompt[:-1])
    n = len(prompt) - 1
    assert backend.self_draft(target, int(prompt[-1]), n, STEPS) == want
    assert target.cache_len == n  # the loop's entries lie past the cache's length, which it leaves as it was
    assert backend.greedy_per_token(target, int(prompt[-1]), n, STEPS) == want
    got = backend.self_draft(target, int(prompt[-1]), n, STEPS, layers=2)
    assert got == backend.greedy_per_token(target, int(prompt[-1]), n, STEPS, layers=2)
    assert backend.self_draft(target, int(prompt[-1]), n, 0) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_a_verifys_embeddings_are_the_weights_own_and_the_cache_stays_bounded(family, monkeypatch):
    model = make_family_model(family, 96)
    weights = backends.quantize_int8(model)
    backend = backends.create(model, "native_cpu", int8=weights)
    monkeypatch.setattr(type(backend), "EMBED_CACHE", 5)
    for ids in ([7], [7, 7, 3], [3, 90, 1, 7], [50, 51, 52, 53, 54, 55], list(range(40))):
        ids = torch.tensor(ids)
        got = backend._embedding(ids)
        assert torch.equal(got, weights.embedding(ids))  # bit for bit, repeated tokens included
        assert got.is_contiguous()
        got.zero_()  # the kernel writes into what it is given: the kept rows must not change
        assert torch.equal(backend._embedding(ids), weights.embedding(ids))
        assert len(backend._embedded) <= 6  # at most EMBED_CACHE, but one batch's tokens are all kept
