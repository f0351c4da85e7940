"""The data structures behind SuffixDecoding-style drafting, in plain Python (no torch): an index of token
sequences by their n-grams, the search for the longest earlier match of the text's suffix, and the
frequency-weighted continuation tree a draft is cut from (Oliaro et al., "SuffixDecoding", 2024).

We index only the ``anchor``-gram ending at each position and extend a hit backwards to measure the match:
one dictionary entry per token keeps memory linear, unlike a suffix trie of depth D (D entries per token).
"""
from __future__ import annotations

import heapq
import threading
from collections import deque
from dataclasses import dataclass, field

# How many of an anchor's most recent occurrences one lookup examines. A common anchor ("of the") can occur
# thousands of times; the newest occurrences are the most relevant and this bounds the cost of a step.
SCAN_LIMIT = 256


@dataclass(frozen=True)
class Match:
    length: int  # matching tokens, at most the requested maximum
    sequence: tuple[int, ...] | list[int]  # the indexed sequence the match is in
    end: int  # index just after the match: the continuation starts here


class SuffixIndex:
    """Token sequences and, for every position, the ``anchor`` tokens ending there -> (sequence id, end)."""

    def __init__(self, anchor: int):
        if anchor < 1:
            raise ValueError(f"anchor must be >= 1, got {anchor}")
        self.anchor = anchor
        self.sequences: dict[int, list[int]] = {}
        self.where: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, tokens: list[int]) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self.sequences[seq_id] = []
        self.extend(seq_id, tokens)
        return seq_id

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append tokens to a sequence and index the anchors that now end inside it."""
        seq = self.sequences[seq_id]
        start = len(seq)
        seq.extend(int(t) for t in tokens)
        for end in range(max(start, self.anchor - 1) + 1, len(seq) + 1):
            self.where.setdefault(tuple(seq[end - self.anchor:end]), []).append((seq_id, end))

    def remove(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id)
        for key in {tuple(seq[e - self.anchor:e]) for e in range(self.anchor, len(seq) + 1)}:
            kept = [hit for hit in self.where.get(key, ()) if hit[0] != seq_id]
            if kept:
                self.where[key] = kept
            else:
                self.where.pop(key, None)

    def matches(self, context: list[int], max_match: int) -> list[Match]:
        """Earlier occurrences of the end of ``context`` that have a continuation, newest first, each with its
        match length (>= anchor, <= max_match)."""
        if len(context) < self.anchor:
            return []
        hits = self.where.get(tuple(context[-self.anchor:]), ())
        out = []
        for seq_id, end in reversed(hits[-SCAN_LIMIT:]):
            seq = self.sequences[seq_id]
            if end >= len(seq):  # nothing follows (e.g. the live text's own suffix)
                continue
            length = self.anchor
            limit = min(max_match, end, len(context))
            while length < limit and seq[end - length - 1] == context[-length - 1]:
                length += 1
            out.append(Match(length, seq, end))
        return out


@dataclass
class DraftTree:
    """A draft cut from the continuation tree, in topological order."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 for children of the root
    probs: list[float] = field(default_factory=list)  # frequency of the token among its parent's continuations
    path_probs: list[float] = field(default_factory=list)  # product of probs along the path


def continuation_tree(continuations: list[list[int]], max_nodes: int, min_prob: float) -> DraftTree:
    """Merge continuations into a trie weighted by how many share each prefix, then keep the most probable
    nodes best-first (probability = share of the continuations that pass through the node) while they reach
    ``min_prob``, at most ``max_nodes``. A parent is always more probable than its child, so it comes first."""
    # trie nodes: token, count, children {token: node index}
    tokens, counts, children = [-1], [len(continuations)], [dict()]
    for cont in continuations:
        node = 0
        for tok in cont:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(tokens)
                tokens.append(tok)
                counts.append(0)
                children.append({})
                children[node][tok] = nxt
            counts[nxt] += 1
            node = nxt
    tree = DraftTree()
    if not continuations:
        return tree
    heap = [(-counts[c] / counts[0], c, -1, counts[c] / counts[0]) for c in children[0].values()]
    heapq.heapify(heap)
    while heap and len(tree.tokens) < max_nodes:
        neg_path, node, parent_draft, prob = heapq.heappop(heap)
        if -neg_path < min_prob:
            break
        index = len(tree.tokens)
        tree.tokens.append(tokens[node])
        tree.parents.append(parent_draft)
        tree.probs.append(prob)
        tree.path_probs.append(-neg_path)
        for c in children[node].values():
            share = counts[c] / counts[node]
            heapq.heappush(heap, (neg_path * share, c, index, share))
    return tree


class OutputHistory:
    """Earlier outputs of this process for one model, as a SuffixIndex; thread-safe, oldest dropped first."""

    def __init__(self, anchor: int, max_outputs: int):
        self.index = SuffixIndex(anchor)
        self.max_outputs = max_outputs
        self._order: deque[int] = deque()
        self._seen: dict[tuple[int, ...], int] = {}  # exact repeats add nothing new: stored once
        self._key_of: dict[int, tuple[int, ...]] = {}
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def add(self, tokens: list[int]) -> bool:
        key = tuple(int(t) for t in tokens)
        with self.lock:
            if not key or key in self._seen:
                return False
            seq_id = self._seen[key] = self.index.add(list(key))
            self._key_of[seq_id] = key
            self._order.append(seq_id)
            while len(self._order) > self.max_outputs:
                old = self._order.popleft()
                del self._seen[self._key_of.pop(old)]
                self.index.remove(old)
            return True

    def matches(self, context: list[int], max_match: int) -> list[Match]:
        with self.lock:
            found = self.index.matches(context, max_match)
            # copy the sequences we point into: another thread may drop them after we release the lock
            return [Match(m.length, tuple(m.sequence[m.end - m.length:]), m.length) for m in found]


class HistoryRegistry:
    """Named output histories, one per (name, model), shared by every run in the process."""

    def __init__(self):
        self._histories: dict[tuple[str, str, int, int], OutputHistory] = {}
        self._lock = threading.Lock()

    def get(self, name: str, model_id: str, vocab_size: int, anchor: int, max_outputs: int) -> OutputHistory:
        # token ids only mean something for one tokenizer: a different model gets a different history; the
        # anchor is part of the key because the index depends on it
        key = (name, str(model_id), int(vocab_size), int(anchor))
        with self._lock:
            history = self._histories.get(key)
            if history is None:
                history = self._histories[key] = OutputHistory(anchor, max_outputs)
            history.max_outputs = max_outputs
            return history

    def clear(self) -> None:
        with self._lock:
            self._histories.clear()
