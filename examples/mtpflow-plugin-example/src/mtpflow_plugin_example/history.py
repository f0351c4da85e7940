"""The earlier outputs this plugin drafts from: a process-wide history per model, over mtpflow's own suffix
index (``mtpflow.suffix_cache.TokenIndex``). What is the plugin's own is the policy: an output is stored once
(an exact repeat adds nothing), the oldest is dropped past ``max_outputs``, and every run of a model shares the
history named in its strategy. Plain Python, no torch.
"""
from __future__ import annotations

import threading
from collections import deque

from mtpflow.suffix_cache import Occurrence, TokenIndex


class OutputHistory:
    """Earlier outputs of this process for one model, as a ``TokenIndex``; thread-safe, oldest dropped first."""

    def __init__(self, anchor: int, max_outputs: int):
        self.index = TokenIndex(anchor)
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
            seq_id = self._seen[key] = self.index.add(key)
            self._key_of[seq_id] = key
            self._order.append(seq_id)
            while len(self._order) > self.max_outputs:
                old = self._order.popleft()
                del self._seen[self._key_of.pop(old)]
                self.index.remove(old)
            return True

    def matches(self, context: list[int], max_match: int, depth: int) -> list[Occurrence]:
        """Earlier occurrences of the end of ``context``, newest first, each with up to ``depth`` following
        tokens (copies: safe to keep after another thread drops the output)."""
        with self.lock:
            return self.index.occurrences(context, max_match, depth)


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
