"""The output history on hand-made token lists: stored once, oldest dropped, shared safely across threads. (The
index and the frequency tree under it are mtpflow's ``mtpflow.suffix_cache``, tested with mtpflow.)"""
from __future__ import annotations

import threading

from mtpflow_plugin_example.history import HistoryRegistry, OutputHistory


def test_history_stores_repeats_once_and_drops_the_oldest():
    history = OutputHistory(anchor=2, max_outputs=2)
    assert history.add([1, 2, 3]) and not history.add([1, 2, 3])
    history.add([4, 5, 6])
    history.add([7, 8, 9])
    assert len(history) == 2
    assert history.matches([1, 2], max_match=4, depth=4) == []
    (m,) = history.matches([4, 5], max_match=4, depth=4)
    assert m.continuation == (6,) and m.length == 2
    assert history.add([1, 2, 3])  # forgotten, so new again


def test_matches_measure_the_longest_common_suffix_newest_first():
    history = OutputHistory(anchor=2, max_outputs=8)
    history.add([1, 2, 3, 4, 5, 6])
    history.add([9, 3, 4, 7])
    found = history.matches([8, 2, 3, 4], max_match=8, depth=2)
    assert [(m.length, m.continuation) for m in found] == [(2, (7,)), (3, (5, 6))]  # newest output first
    assert [m.length for m in history.matches([8, 2, 3, 4], max_match=2, depth=2)] == [2, 2]  # capped
    assert history.matches([5, 6], max_match=8, depth=2) == []  # the anchor ends its output: nothing follows


def test_registry_keeps_one_history_per_name_and_model():
    registry = HistoryRegistry()
    a = registry.get("default", "model-a", 100, anchor=2, max_outputs=4)
    assert registry.get("default", "model-a", 100, anchor=2, max_outputs=8) is a and a.max_outputs == 8
    assert registry.get("default", "model-b", 100, anchor=2, max_outputs=4) is not a
    assert registry.get("default", "model-a", 100, anchor=3, max_outputs=4) is not a  # the index depends on it
    registry.clear()
    assert registry.get("default", "model-a", 100, anchor=2, max_outputs=4) is not a


def test_history_is_safe_across_threads():
    history = OutputHistory(anchor=2, max_outputs=8)

    def work(offset):
        for i in range(50):
            history.add([offset, i, i + 1, i + 2])
            history.matches([i, i + 1], max_match=4, depth=2)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(history) == 8
