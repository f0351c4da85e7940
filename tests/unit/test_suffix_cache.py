"""The core suffix cache (``mtpflow.suffix_cache``): matches and their continuations, frequency-scored trees,
deduplication, least-recently-used eviction under a byte bound that holds after 200 requests (and agrees with
what Python really allocated), and concurrent use from several threads."""
from __future__ import annotations

import random
import threading
import tracemalloc

import pytest

from mtpflow.suffix_cache import SuffixCache, TokenIndex, frequency_tree


def test_occurrences_newest_first_with_match_length_and_continuation():
    index = TokenIndex(anchor=2)
    index.add([5, 1, 2, 3, 7, 8])
    index.add([9, 2, 3, 4, 4])
    found = index.occurrences([0, 1, 2, 3], max_match=8, depth=2)
    assert [(o.length, o.continuation) for o in found] == [(2, (4, 4)), (3, (7, 8))]
    # the match is measured no further back than max_match, nor past the start of either text
    assert [o.length for o in index.occurrences([1, 2, 3], max_match=2, depth=1)] == [2, 2]
    assert index.occurrences([7], 8, 4) == []  # shorter than the anchor
    assert index.occurrences([4, 4], 8, 4) == []  # ends its sequence: nothing follows


def test_a_growing_sequence_matches_its_own_earlier_text():
    index = TokenIndex(anchor=2)
    seq = index.add([1, 2, 3])
    index.extend(seq, [4, 1, 2])
    found = index.occurrences(list(index.sequences[seq]), 16, 3)
    assert [(o.length, o.continuation) for o in found] == [(2, (3, 4, 1))]


def test_remove_leaves_nothing_behind():
    index = TokenIndex(anchor=3)
    empty = index.nbytes()
    a = index.add(list(range(50)))
    b = index.add(list(range(25, 75)))
    index.remove(a)
    assert [o.seq_id for o in index.occurrences([30, 31, 32], 8, 1)] == [b]
    index.remove(b)
    assert not index.where and not index.sequences and not index.weights
    assert index._payload == 0 and index.nbytes() <= empty + 1024


def test_frequency_tree_scores_continuations_by_weight():
    tree = frequency_tree([((1, 2, 3), 3), ((1, 2, 4), 1), ((5,), 1)], max_nodes=10)
    nodes = {tuple(_path(tree, i)): (tree.probs[i], tree.path_probs[i]) for i in range(len(tree))}
    assert nodes[(1,)] == pytest.approx((0.8, 0.8))
    assert nodes[(1, 2)] == pytest.approx((1.0, 0.8))
    assert nodes[(1, 2, 3)] == pytest.approx((0.75, 0.6))
    assert nodes[(1, 2, 4)] == pytest.approx((0.25, 0.2))
    assert nodes[(5,)] == pytest.approx((0.2, 0.2))
    assert all(p < i for i, p in enumerate(tree.parents))  # topological order
    # most probable nodes first, min_prob drops the tail
    assert len(frequency_tree([((1, 2, 3), 3), ((1, 2, 4), 1), ((5,), 1)], max_nodes=3)) == 3
    assert len(frequency_tree([((1, 2, 3), 3), ((1, 2, 4), 1), ((5,), 1)], 10, min_prob=0.5)) == 3
    assert len(frequency_tree([], 10)) == 0


def _path(tree, i):
    out = []
    while i >= 0:
        out.append(tree.tokens[i])
        i = tree.parents[i]
    return out[::-1]


def test_a_repeated_output_raises_its_weight_instead_of_being_stored_again():
    cache = SuffixCache(max_bytes=1 << 20)
    assert cache.add([1, 2, 3, 4, 5]) is True
    size = cache.nbytes()
    assert cache.add([1, 2, 3, 4, 5]) is False
    assert len(cache) == 1 and cache.nbytes() == size
    assert [o.weight for o in cache.lookup([1, 2, 3], 8, 2)] == [2]
    assert cache.add([1, 2]) is False and len(cache) == 1  # too short to index: ignored


def test_least_recently_used_outputs_are_evicted_first():
    one = [10 + i for i in range(40)]
    cache = SuffixCache(max_bytes=1 << 20)
    cache.add(one)
    cache.max_bytes = cache.nbytes() * 2 + 2048  # room for about two outputs
    cache.add([100 + i for i in range(40)])
    cache.lookup(one[:5], 8, 3)  # drafting from the first output makes it the most recently used
    cache.add([200 + i for i in range(40)])
    assert cache.evicted >= 1
    assert cache.lookup(one[:5], 8, 3), "the output just used was evicted"
    assert not cache.lookup([100, 101, 102], 8, 3)
    assert cache.nbytes() <= cache.max_bytes


def _request(rng: random.Random, n: int) -> list[int]:
    # text-like: a few hundred frequent tokens and a long tail
    return [rng.randrange(300) if rng.random() < 0.6 else rng.randrange(49152) for _ in range(n)]


@pytest.mark.parametrize("max_bytes", [256 << 10, 4 << 20])
def test_memory_stays_under_the_bound_after_200_requests(max_bytes):
    rng = random.Random(0)
    cache = SuffixCache(max_bytes=max_bytes)
    for i in range(200):
        tokens = _request(rng, 300)
        cache.add(tokens)
        assert cache.nbytes() <= max_bytes
        if i % 3 == 0:
            cache.add(_request(random.Random(i // 3), 300))  # a retry: same tokens again
            assert cache.nbytes() <= max_bytes
        for cut in range(10, 300, 29):  # drafting reorders the recency table, which may resize it
            cache.lookup(tokens[:cut], 32, 8)
            assert cache.nbytes() <= max_bytes
    assert len(cache) > 0
    if max_bytes < 1 << 20:
        assert cache.evicted > 0


def test_the_byte_count_matches_what_python_allocated():
    """``nbytes`` is kept by hand (``sys.getsizeof`` of every object the cache holds): check it against
    tracemalloc, which sees every allocation, including after evictions."""
    rng = random.Random(1)
    requests = [_request(rng, 120) for _ in range(120)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = SuffixCache(max_bytes=600 << 10)
        for r in requests:
            cache.add(r)
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.evicted > 0
    assert 0.8 * traced <= cache.nbytes() <= 1.2 * traced + 4096, (cache.nbytes(), traced)


def test_concurrent_adds_and_lookups_keep_the_cache_consistent():
    cache = SuffixCache(max_bytes=512 << 10)
    errors: list[BaseException] = []

    def worker(seed: int):
        rng = random.Random(seed)
        try:
            for _ in range(60):
                tokens = _request(rng, 150)
                cache.add(tokens)
                for cut in (20, 80, 140):
                    for o in cache.lookup(tokens[:cut], 32, 8):
                        assert o.length >= 2 and len(o.continuation) <= 8
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert cache.nbytes() <= cache.max_bytes
    index = cache.index
    # every indexed occurrence points into a stored sequence, and every stored sequence is indexed
    stored = set(index.sequences)
    assert stored == set(cache._recent) == set(index.weights)
    for hits in index.where.values():
        assert all((h >> 32) in stored for h in hits) and list(hits) == sorted(hits)
    assert sum(len(h) for h in index.where.values()) == sum(len(s) - 1 for s in index.sequences.values())
