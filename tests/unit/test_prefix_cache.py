"""The prefix KV cache (``mtpflow.prefix_cache``): a prompt that starts like an earlier one copies that prefix's
keys and values (and taps) instead of running it, and decodes exactly as without the cache (HF greedy); the
cache is bounded in bytes and checks hits token by token."""
from __future__ import annotations

import torch

from helpers import hf_greedy, tiny_loaded
from mtpflow.config import compose
from mtpflow.engine import Engine
from mtpflow.kv_cache import KVPool
from mtpflow.prefix_cache import BLOCK, PrefixKVCache, block_hashes
from mtpflow.request import Request
from mtpflow.target import Target


def tokens(*parts: list[int]) -> torch.Tensor:
    return torch.tensor([t for p in parts for t in p], dtype=torch.long)


def test_lookup_finds_the_longest_stored_block_prefix_and_checks_tokens():
    cache = PrefixKVCache(max_bytes=10**8)
    system = list(range(1, 2 * BLOCK + 5))  # two whole blocks and a bit
    first = tokens(system, [300, 301, 302])
    keys = [torch.randn(2, first.numel(), 4) for _ in range(3)]
    cache.store(first, keys, [k + 1 for k in keys])
    assert len(cache) == 1 and cache.lookup(tokens([9] * 40)) is None
    entry, n = cache.lookup(tokens(system, [400, 401]))
    assert n == 2 * BLOCK and torch.equal(entry.keys[0][:, :n], keys[0][:, :n])
    assert cache.lookup(tokens(system[:BLOCK])) is None  # at least one token is left to run: 16 - 1 < 16
    assert cache.lookup(tokens(system[:BLOCK + 3]))[1] == BLOCK
    # a lookup that needs taps only takes an entry that kept the same taps
    assert cache.lookup(tokens(system, [7]), taps=(-1,)) is None
    assert block_hashes(first, 2 * BLOCK) == block_hashes(tokens(system, [5]), 2 * BLOCK)


def test_bounded_in_bytes_least_recently_used_leave_first():
    one = 2 * 3 * BLOCK * 4 * 4 * 2  # bytes of one one-block entry: 3 layers of keys and values [2, 16, 4] fp32
    cache = PrefixKVCache(max_bytes=2 * one)
    prompts = [tokens([i] * (BLOCK + 1)) for i in range(1, 6)]
    for p in prompts[:2]:
        cache.store(p, [torch.zeros(2, BLOCK + 1, 4)] * 3, [torch.zeros(2, BLOCK + 1, 4)] * 3)
    assert cache.lookup(prompts[0]) is not None  # 0 is now the most recent
    cache.store(prompts[2], [torch.zeros(2, BLOCK + 1, 4)] * 3, [torch.zeros(2, BLOCK + 1, 4)] * 3)
    assert cache.nbytes <= cache.max_bytes and len(cache) == 2
    assert cache.lookup(prompts[1]) is None and cache.lookup(prompts[0]) is not None
    for i in range(200):
        cache.store(tokens([i % 250 + 1, 7] * BLOCK), [torch.zeros(2, 2 * BLOCK, 4)] * 3,
                    [torch.zeros(2, 2 * BLOCK, 4)] * 3)
        assert cache.nbytes <= cache.max_bytes


def test_a_prefix_hit_gives_the_same_logits_taps_and_cache_as_a_full_prefill():
    loaded = tiny_loaded(seed=4, layers=2)
    g = torch.Generator().manual_seed(4)
    system = torch.randint(1, 300, (2 * BLOCK + 3,), generator=g)
    prompt = torch.cat([system, torch.randint(1, 300, (9,), generator=g)])
    pool = KVPool(loaded.model, 3)
    full = Target(loaded.model, need_hidden=True, pool=pool)
    logits_full, hidden_full = full.prefill(prompt)
    cache = PrefixKVCache(max_bytes=10**8)
    # an earlier prompt with the same system prompt, prefilled (and stored) through the cache
    assert Target(loaded.model, need_hidden=True, pool=pool).prefill_cached(
        torch.cat([system, torch.tensor([5, 6])]), cache)[2] == 0
    reused = Target(loaded.model, need_hidden=True, pool=pool)
    logits, hidden, n = reused.prefill_cached(prompt, cache)
    assert n == 2 * BLOCK and cache.hits == 1
    torch.testing.assert_close(logits, logits_full)
    torch.testing.assert_close(hidden, hidden_full)
    assert reused.cache_len == full.cache_len == prompt.numel()
    for layer in range(pool.num_layers):
        torch.testing.assert_close(reused.kv.keys(layer), full.kv.keys(layer))
        m = prompt.numel()
        torch.testing.assert_close(pool.values[layer][reused.kv.slot, :, :m], pool.values[layer][full.kv.slot, :, :m])


def test_engine_reuses_a_shared_system_prompt_and_decodes_as_hf():
    loaded = tiny_loaded(seed=8, layers=2)
    g = torch.Generator().manual_seed(8)
    system = torch.randint(1, 300, (3 * BLOCK + 2,), generator=g).tolist()
    prompts = [system + torch.randint(1, 300, (int(n),), generator=g).tolist() for n in (5, 9, 1, 20, 12, 3)]
    strategies = [("baseline", {}), ("pld", {"propose.costs": None}), ("jacobi", {"k": 3}), ("adaptive", {"propose.costs": None})]
    engine = Engine(compose(["strategy=baseline", "trace=off", "max_new_tokens=12", "batch_k=off",
                             "max_batch_size=4"]), loaded=loaded)
    try:
        first = engine.generate(Request(prompt_ids=prompts[0]))  # stores the prefix
        results = engine.generate([Request(prompt_ids=p, strategy=strategies[i % 4][0], overrides=strategies[i % 4][1])
                                   for i, p in enumerate(prompts)])
        cache = engine.shared.get("prefix_kv", lambda: None)
    finally:
        engine.close()
    assert first.token_ids == hf_greedy(loaded.model, prompts[0], 12)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(loaded.model, prompt, 12)
        assert result.stats.get("prefix_cached_tokens", 0) >= 3 * BLOCK
    assert cache.hits >= len(prompts) and cache.nbytes <= cache.max_bytes


def test_prefix_cache_mb_zero_turns_it_off():
    loaded = tiny_loaded(seed=9, layers=2)
    engine = Engine(compose(["strategy=baseline", "trace=off", "max_new_tokens=4", "prefix_cache_mb=0"]),
                    loaded=loaded)
    try:
        prompt = list(range(1, 3 * BLOCK))
        engine.generate([Request(prompt_ids=prompt), Request(prompt_ids=prompt)])
        assert "prefix_kv" not in engine.shared.names()
    finally:
        engine.close()
