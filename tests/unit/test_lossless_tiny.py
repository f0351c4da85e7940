"""Every lossless strategy emits exactly HF greedy generate's token ids on tiny random models."""
from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, make_pipeline, make_tiny_model, tiny_loaded

LOSSLESS = ["baseline", "pld", "jacobi", "adaptive"]


def prompts(vocab: int, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 40, (1,), generator=g))
        base = torch.randint(1, vocab, (length,), generator=g)
        if i % 2:  # repetitive prompts give prompt lookup something to match
            base = base[: max(3, length // 3)].repeat(3)
        out.append(base.tolist())
    return out


@pytest.mark.parametrize("strategy", LOSSLESS)
def test_matches_hf_greedy(tiny, strategy):
    for i, ids in enumerate(prompts(len(tiny.tokenizer), 8)):
        pipe = make_pipeline(tiny, strategy, "max_new_tokens=40")
        got = pipe(prompt_ids=ids).token_ids
        assert got == hf_greedy(tiny.model, ids, 40), f"prompt {i}"


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 16])
def test_pld_any_k(tiny, k):
    for ids in prompts(len(tiny.tokenizer), 4, seed=k):
        pipe = make_pipeline(tiny, "pld", "max_new_tokens=32", f"k={k}",
                             "strategy.propose.min_ngram=1")
        assert pipe(prompt_ids=ids).token_ids == hf_greedy(tiny.model, ids, 32)


def test_draft_model_tiny(tiny):
    pipe = make_pipeline(tiny, "draft_model", "max_new_tokens=32", "strategy.propose.layers=1")
    for ids in prompts(len(tiny.tokenizer), 4):
        assert pipe(prompt_ids=ids).token_ids == hf_greedy(tiny.model, ids, 32)


def test_other_seeds_and_depths():
    for seed in (3, 4):
        loaded = tiny_loaded(seed=seed, layers=3)
        for ids in prompts(len(loaded.tokenizer), 3, seed=seed):
            pipe = make_pipeline(loaded, "pld", "max_new_tokens=48", "strategy.propose.min_ngram=1")
            assert pipe(prompt_ids=ids).token_ids == hf_greedy(loaded.model, ids, 48)


@pytest.mark.parametrize("layers", [1, 2])
def test_self_draft_on_the_shared_cache_is_lossless(layers):
    loaded = tiny_loaded(seed=4, layers=3)
    for ids in prompts(len(loaded.tokenizer), 3, seed=layers):
        pipe = make_pipeline(loaded, "draft_model", "max_new_tokens=40", f"strategy.propose.layers={layers}",
                             "strategy.propose.cost_aware=false")
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(loaded.model, ids, 40)
        assert result.stats["draft_tokens"] > 0  # it really drafted (cost_aware off)


def test_a_self_draft_with_every_layer_is_always_accepted():
    """With all of the target's layers the self-draft is the target itself: drafting on the target's cache
    (right positions, cropped back before the verify) must reproduce its greedy choices, so every draft
    token is accepted."""
    loaded = tiny_loaded(seed=4, layers=3)
    checked = 0
    for ids in prompts(len(loaded.tokenizer), 3, seed=9):
        pipe = make_pipeline(loaded, "draft_model", "max_new_tokens=40", "strategy.propose.layers=3",
                             "strategy.propose.cost_aware=false")
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(loaded.model, ids, 40)
        if len(result.token_ids) >= 10:  # (one of these prompts ends at once)
            checked += 1
            assert result.stats["draft_tokens"] > 0 and result.stats["acceptance_rate"] == 1.0
            assert result.stats["mal"] > 4  # K = 6: up to 7 tokens a step
    assert checked >= 2


@pytest.mark.parametrize("same", [True, False])
def test_a_separate_draft_model_on_its_own_cache_is_lossless(tmp_path, same):
    """``strategy.propose.model=<path>``: the draft model keeps its own cache and catches it up on the tokens
    committed since its last draft. Drafting with a copy of the target itself, every draft token must be
    accepted; with another model, the output must still be the target's."""
    from helpers import make_tiny_tokenizer

    loaded = tiny_loaded(seed=4, layers=3)
    draft = loaded.model if same else make_tiny_model(len(loaded.tokenizer), seed=7, layers=1)
    draft.save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    checked = 0
    for ids in prompts(len(loaded.tokenizer), 3, seed=9):
        pipe = make_pipeline(loaded, "draft_model", "max_new_tokens=40", f"strategy.propose.model={tmp_path}",
                             "strategy.propose.cost_aware=false")
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(loaded.model, ids, 40)
        if len(result.token_ids) >= 10:
            checked += 1
            assert result.stats["draft_tokens"] > 0
            if same:
                assert result.stats["acceptance_rate"] == 1.0 and result.stats["mal"] > 4
    assert checked >= 2
