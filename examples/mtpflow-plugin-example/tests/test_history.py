"""The suffix index, the continuation tree and the output history, on hand-made token lists."""
from __future__ import annotations

import threading

from mtpflow_plugin_example.suffix_index import OutputHistory, SuffixIndex, continuation_tree


def test_matches_measure_the_longest_common_suffix_newest_first():
    index = SuffixIndex(anchor=2)
    old = index.add([1, 2, 3, 4, 5, 6])
    new = index.add([9, 3, 4, 7])
    found = index.matches([8, 2, 3, 4], max_match=8)
    assert [(m.length, m.end) for m in found] == [(2, 3), (3, 4)]  # newest sequence first
    assert found[1].sequence == index.sequences[old]
    assert index.matches([8, 2, 3, 4], max_match=2)[1].length == 2  # capped
    assert index.matches([5, 6], max_match=8) == []  # the anchor ends its sequence: nothing follows
    index.remove(new)
    assert [m.end for m in index.matches([2, 3, 4], max_match=8)] == [4]
    assert all(hit[0] != new for hits in index.where.values() for hit in hits)


def test_extend_indexes_only_new_anchors():
    index = SuffixIndex(anchor=2)
    seq = index.add([1, 2])
    index.extend(seq, [3, 1, 2, 5])
    assert index.where[(1, 2)] == [(seq, 2), (seq, 5)]
    assert [m.sequence[m.end] for m in index.matches([1, 2], max_match=4)] == [5, 3]


def test_continuation_tree_keeps_frequent_branches_best_first():
    conts = [[10, 11, 12], [10, 11, 13], [10, 11, 12], [20]]
    tree = continuation_tree(conts, max_nodes=16, min_prob=0.0)
    assert tree.tokens[:2] == [10, 11] and tree.parents[:2] == [-1, 0]
    assert tree.path_probs[:2] == [0.75, 0.75]
    assert all(p < i for i, p in enumerate(tree.parents))  # topological order
    by_token = dict(zip(tree.tokens, tree.path_probs))
    assert by_token[12] == 0.5 and by_token[13] == 0.25 and by_token[20] == 0.25
    pruned = continuation_tree(conts, max_nodes=16, min_prob=0.3)
    assert pruned.tokens == [10, 11, 12]
    assert continuation_tree(conts, max_nodes=2, min_prob=0.0).tokens == [10, 11]
    assert continuation_tree([], max_nodes=4, min_prob=0.0).tokens == []


def test_history_stores_repeats_once_and_drops_the_oldest():
    history = OutputHistory(anchor=2, max_outputs=2)
    assert history.add([1, 2, 3]) and not history.add([1, 2, 3])
    history.add([4, 5, 6])
    history.add([7, 8, 9])
    assert len(history) == 2
    assert history.matches([1, 2], max_match=4) == []
    (m,) = history.matches([4, 5], max_match=4)
    assert list(m.sequence[m.end:]) == [6]
    assert history.add([1, 2, 3])  # forgotten, so new again


def test_history_is_safe_across_threads():
    history = OutputHistory(anchor=2, max_outputs=8)

    def work(offset):
        for i in range(50):
            history.add([offset, i, i + 1, i + 2])
            history.matches([i, i + 1], max_match=4)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(history) == 8
