"""The suffix cache: token sequences (earlier outputs of this engine, or one request's own prompt and output)
indexed so that the end of the current text can be matched against them, and the frequency-scored draft trees
cut from what followed the matches (SuffixDecoding, Oliaro et al. 2024). Plain Python, no torch.

``TokenIndex`` is the structure (one request's text uses it as is); ``SuffixCache`` wraps one for state shared
across requests: thread-safe, deduplicated (a repeated output raises its frequency instead of being stored
again), bounded to ``max_bytes`` by evicting the least recently used sequences, with a byte count it keeps
itself (``nbytes``). Rather than a suffix trie of depth D (D nodes per token) the index holds one entry per
token: the ``anchor`` tokens ending at each position, and a hit is extended backwards to measure the match.
"""
from __future__ import annotations

import heapq
import sys
import threading
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field

KEY_BITS = 21  # bits per token id in an anchor key: vocabularies up to 2M tokens
SEQ_SHIFT = 32  # an occurrence is packed as seq_id << SEQ_SHIFT | end
# A common anchor (", the") can occur thousands of times; a lookup examines only its newest occurrences, which
# bounds the cost of a step and favours recent text.
SCAN_LIMIT = 256
_ENTRY = 8  # bytes of one packed occurrence (array 'q')


def _key(tokens) -> int:
    key = 0
    for t in tokens:
        key = (key << KEY_BITS) | int(t)
    return key


@dataclass(frozen=True)
class Occurrence:
    """An earlier occurrence of the end of the text: its match length and what followed it."""

    length: int  # matching tokens (>= the anchor, <= the requested maximum)
    weight: int  # how often the sequence it is in was seen (a repeated output counts more)
    continuation: tuple[int, ...]  # the tokens after the match, at most the requested depth
    seq_id: int = -1
    end: int = 0  # index in its sequence just after the match


class TokenIndex:
    """Token sequences plus, for every position, the ``anchor`` tokens ending there -> (sequence, end).

    Not thread-safe by itself (a request's own index is used by one thread); ``SuffixCache`` locks around it.
    Occurrence arrays stay sorted (sequence ids only grow and a sequence is extended at its end), so removing
    a sequence cuts one slice per anchor.
    """

    def __init__(self, anchor: int = 2):
        if anchor < 1:
            raise ValueError(f"anchor must be >= 1, got {anchor}")
        self.anchor = anchor
        self.sequences: dict[int, array] = {}  # seq_id -> tokens (array 'i')
        self.weights: dict[int, int] = {}  # seq_id -> times seen
        self.where: dict[int, array] = {}  # anchor key -> packed occurrences (array 'q'), sorted
        self._next_id = 0
        self._payload = 0  # bytes of the objects the dicts point to (keys, arrays, weights)
        self._peak_keys = 0

    def __len__(self) -> int:
        return len(self.sequences)

    def nbytes(self) -> int:
        """Bytes this index holds: its dictionaries' tables plus every key, array and weight they point to
        (``sys.getsizeof``, kept up to date on every change)."""
        return (self._payload + sys.getsizeof(self.sequences) + sys.getsizeof(self.weights)
                + sys.getsizeof(self.where))

    def add(self, tokens, weight: int = 1) -> int:
        seq_id = self._next_id
        self._next_id += 1
        if seq_id >= 1 << 31:
            raise OverflowError("too many sequences for one index")
        seq = array("i")
        self.sequences[seq_id] = seq
        self.weights[seq_id] = int(weight)
        self._payload += sys.getsizeof(seq) + sys.getsizeof(seq_id) + sys.getsizeof(int(weight))
        self.extend(seq_id, tokens)
        return seq_id

    def extend(self, seq_id: int, tokens) -> None:
        """Append tokens to a sequence and index the anchors that now end inside it."""
        seq = self.sequences[seq_id]
        before = sys.getsizeof(seq)
        start = len(seq)
        seq.extend(int(t) for t in tokens)
        self._payload += sys.getsizeof(seq) - before
        a = self.anchor
        base = seq_id << SEQ_SHIFT
        for end in range(max(start, a - 1) + 1, len(seq) + 1):
            key = _key(seq[end - a:end])
            hits = self.where.get(key)
            if hits is None:
                hits = self.where[key] = array("q")
                self._payload += sys.getsizeof(key) + sys.getsizeof(hits)
                self._peak_keys = max(self._peak_keys, len(self.where))
            size = sys.getsizeof(hits)
            hits.append(base | end)
            self._payload += sys.getsizeof(hits) - size

    def remove(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id)
        weight = self.weights.pop(seq_id)
        self._payload -= sys.getsizeof(seq) + sys.getsizeof(seq_id) + sys.getsizeof(weight)
        a = self.anchor
        lo_value, hi_value = seq_id << SEQ_SHIFT, (seq_id + 1) << SEQ_SHIFT
        for key in {_key(seq[e - a:e]) for e in range(a, len(seq) + 1)}:
            hits = self.where[key]
            size = sys.getsizeof(hits)
            lo = bisect_left(hits, lo_value)
            hi = bisect_left(hits, hi_value, lo)
            if hi - lo == len(hits):
                del self.where[key]
                self._payload -= size + sys.getsizeof(key)
                continue
            del hits[lo:hi]
            self._payload += sys.getsizeof(hits) - size
        if len(self.where) * 4 < self._peak_keys:  # a dict never shrinks its table: copy it when sparse
            self.where = dict(self.where)
            self._peak_keys = len(self.where)

    def touch(self, seq_id: int, weight: int = 1) -> None:
        """The sequence was seen again: count it ``weight`` more times."""
        old = self.weights[seq_id]
        self.weights[seq_id] = old + int(weight)
        self._payload += sys.getsizeof(old + int(weight)) - sys.getsizeof(old)

    def occurrences(self, context, max_match: int, depth: int, scan_limit: int = SCAN_LIMIT) -> list[Occurrence]:
        """Earlier occurrences of the end of ``context`` (a list of ids) that have a continuation, newest first,
        each with its match length (anchor..max_match), its sequence weight and up to ``depth`` following
        tokens. An occurrence that ends where its sequence ends (nothing follows) is skipped."""
        a = self.anchor
        if len(context) < a or depth < 1:
            return []
        hits = self.where.get(_key(context[-a:]))
        if not hits:
            return []
        mask = (1 << SEQ_SHIFT) - 1
        limit = min(max_match, len(context))
        out = []
        for packed in reversed(hits[-scan_limit:]):
            seq_id, end = packed >> SEQ_SHIFT, packed & mask
            seq = self.sequences[seq_id]
            if end >= len(seq):
                continue
            length = a
            reach = min(limit, end)
            while length < reach and seq[end - length - 1] == context[-length - 1]:
                length += 1
            out.append(Occurrence(length, self.weights[seq_id], tuple(seq[end:end + depth]), seq_id, end))
        return out


class SuffixCache:
    """Sequences shared across requests (earlier outputs): a ``TokenIndex`` behind a lock, bounded in bytes.

    ``add`` stores a sequence (at most ``max_sequence`` tokens, its head kept) or, when the same tokens are
    already stored, raises their weight; either way the sequence becomes the most recently used. ``lookup``
    also marks the sequences it drafts from as used. After either the least recently used sequences are
    evicted until ``nbytes() <= max_bytes``, so the bound holds after every call.
    """

    def __init__(self, max_bytes: int = 16 << 20, anchor: int = 2, max_sequence: int = 4096,
                 scan_limit: int = SCAN_LIMIT):
        if max_bytes < 1 or max_sequence < 1 or scan_limit < 1:
            raise ValueError("max_bytes, max_sequence and scan_limit must be >= 1")
        self.max_bytes = int(max_bytes)
        self.max_sequence = int(max_sequence)
        self.scan_limit = int(scan_limit)
        self.index = TokenIndex(anchor)
        self._recent: dict[int, None] = {}  # seq_id -> None, least recently used first (dicts keep order)
        self._by_content: dict[int, list[int]] = {}  # hash of the tokens -> seq_ids with that hash
        self._lock = threading.Lock()
        self._peak = 0  # most sequences held since the tables were last compacted
        self.evicted = 0
        self.added = 0

    @property
    def anchor(self) -> int:
        return self.index.anchor

    def __len__(self) -> int:
        with self._lock:
            return len(self.index)

    def nbytes(self) -> int:
        """Bytes held: the index plus the recency and deduplication tables (kept up to date, not sampled)."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        # the _by_content lists hold one or (on a hash collision) a few ids: counted as a one-id list each
        lists = len(self._by_content) * (sys.getsizeof([0]) + 32)
        return self.index.nbytes() + sys.getsizeof(self._recent) + sys.getsizeof(self._by_content) + lists

    def add(self, tokens, weight: int = 1) -> bool:
        """Store ``tokens`` (a list of ids); True when new, False when it raised a stored copy's weight."""
        tokens = [int(t) for t in tokens][: self.max_sequence]
        if len(tokens) <= self.anchor:
            return False
        digest = hash(tuple(tokens))
        with self._lock:
            self.added += 1
            for seq_id in self._by_content.get(digest, ()):
                if list(self.index.sequences[seq_id]) == tokens:
                    self.index.touch(seq_id, weight)
                    self._recent.pop(seq_id)
                    self._recent[seq_id] = None
                    self._enforce_bound()
                    return False
            seq_id = self.index.add(tokens, weight)
            self._recent[seq_id] = None
            self._peak = max(self._peak, len(self._recent))
            self._by_content.setdefault(digest, []).append(seq_id)
            self._enforce_bound()
            return seq_id in self._recent

    def _enforce_bound(self) -> None:
        while self._nbytes() > self.max_bytes and self._recent:
            self._evict(next(iter(self._recent)))

    def _evict(self, seq_id: int) -> None:
        digest = hash(tuple(self.index.sequences[seq_id]))
        same = self._by_content.get(digest, [])
        if seq_id in same:
            same.remove(seq_id)
            if not same:
                del self._by_content[digest]
        del self._recent[seq_id]
        self.index.remove(seq_id)
        self.evicted += 1
        if len(self._recent) * 4 < self._peak:  # a dict never shrinks its own table: copy them when sparse
            self._recent, self._by_content = dict(self._recent), dict(self._by_content)
            self._peak = len(self._recent)

    def clear(self) -> None:
        with self._lock:
            self.index = TokenIndex(self.index.anchor)
            self._recent, self._by_content = {}, {}
            self._peak = 0

    def lookup(self, context, max_match: int, depth: int) -> list[Occurrence]:
        """``TokenIndex.occurrences`` under the lock; the continuations are copies, safe to keep."""
        with self._lock:
            found = self.index.occurrences(context, max_match, depth, self.scan_limit)
            if found:
                best = max(o.length for o in found)
                for o in found:
                    if o.length == best and o.seq_id in self._recent:
                        self._recent.pop(o.seq_id)
                        self._recent[o.seq_id] = None
                self._enforce_bound()  # re-inserting can make the recency table resize
            return found


@dataclass
class DraftTree:
    """A draft tree in topological order: ``parents`` index into the same lists, -1 for a child of the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # share of its parent's weight that continues with it
    path_probs: list[float] = field(default_factory=list)  # product of probs from the root

    def __len__(self) -> int:
        return len(self.tokens)


def frequency_tree(continuations: list[tuple[tuple[int, ...], int]], max_nodes: int, min_prob: float = 0.0) -> DraftTree:
    """Merge weighted continuations into a trie and keep its ``max_nodes`` most probable nodes, where a node's
    probability is the product along its path of (weight through the child / weight through the parent)
    (SuffixDecoding's frequency score). Nodes under ``min_prob`` are dropped; a parent is never less
    probable than its child, so the result is closed under ancestors and in topological order."""
    tree = DraftTree()
    children: list[dict[int, int]] = [{}]
    tokens: list[int] = [-1]
    counts: list[float] = [0.0]
    for cont, weight in continuations:
        if not cont:
            continue
        counts[0] += weight
        node = 0
        for tok in cont:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(tokens)
                tokens.append(tok)
                counts.append(0.0)
                children.append({})
                children[node][tok] = nxt
            counts[nxt] += weight
            node = nxt
    if not counts[0]:
        return tree
    heap = [(-counts[c] / counts[0], c, -1, counts[c] / counts[0]) for c in children[0].values()]
    heapq.heapify(heap)
    while heap and len(tree.tokens) < max_nodes:
        neg_path, node, parent, prob = heapq.heappop(heap)
        if -neg_path < min_prob:
            break
        index = len(tree.tokens)
        tree.tokens.append(tokens[node])
        tree.parents.append(parent)
        tree.probs.append(prob)
        tree.path_probs.append(-neg_path)
        for c in children[node].values():
            share = counts[c] / counts[node]
            heapq.heappush(heap, (neg_path * share, c, index, share))
    return tree
