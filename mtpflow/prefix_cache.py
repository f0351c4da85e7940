"""KV of prompt prefixes seen before, reused by later prompts that start the same way (automatic prefix caching).

A chat template's system prompt, an agent's instructions, a retried or templated request: their prompts share a
prefix, and its keys and values are the same whatever follows (attention is causal). After a prefill the
engine stores the prompt's keys and values (and its hidden-state taps, where the sequence's stages read them)
in blocks of ``BLOCK`` tokens; a later prompt's prefill copies the longest stored prefix into its cache slot
and runs the model over the rest only. At least one prompt token is always run (its logits give the first
token).

Keyed by a chain of block hashes (block i's key hashes block i's tokens with block i-1's key), so a lookup is
linear in the prompt's length; a hit is checked token by token. Bounded in bytes (``max_bytes``), least recently
used entries leave first; thread-safe. The engine keeps one in ``RunContext.shared`` as ``prefix_kv``
(``prefix_cache_mb`` in the config; 0 turns it off).
"""
from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass

import torch

BLOCK = 16


@dataclass
class _Entry:
    tokens: torch.Tensor  # [n] the prefix, n a multiple of BLOCK
    keys: list[torch.Tensor]  # per layer [kv_heads, n, head_dim]
    values: list[torch.Tensor]
    taps: tuple  # the hidden-state taps ``hidden`` holds; () when none were kept
    hidden: torch.Tensor | None  # [n, ...] the prefill's taps for these positions
    hashes: list[int]

    def __post_init__(self) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values)) + (
            0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size())


def block_hashes(tokens: torch.Tensor, n: int) -> list[int]:
    """The chained key of each block boundary up to ``n`` tokens: entry i covers ``tokens[: (i + 1) * BLOCK]``."""
    ids = tokens[: n - n % BLOCK].tolist()
    out, h = [], 0
    for i in range(0, len(ids), BLOCK):
        h = hash((h, tuple(ids[i : i + BLOCK])))
        out.append(h)
    return out


class PrefixKVCache:
    """Stored prompt prefixes' keys, values and taps; ``lookup`` finds the longest one a prompt starts with."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self.hits = self.misses = 0
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # LRU order
        self._index: dict[int, int] = {}  # block-chain key -> entry id
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: torch.Tensor, taps: tuple = (), hashes: list[int] | None = None) -> tuple[_Entry, int] | None:
        """The entry holding the longest stored prefix of ``tokens`` (leaving at least one token to run) and its
        length, or None. An entry only serves a sequence that needs taps if it kept the same taps. ``hashes``:
        ``block_hashes(tokens, len(tokens))`` if the caller has them (``store`` takes the same)."""
        usable = (int(tokens.numel()) - 1) // BLOCK
        hashes = (block_hashes(tokens, int(tokens.numel())) if hashes is None else hashes)[:usable]
        with self._lock:
            for i in range(len(hashes) - 1, -1, -1):
                entry_id = self._index.get(hashes[i])
                entry = self._entries.get(entry_id) if entry_id is not None else None
                n = (i + 1) * BLOCK
                if entry is None or (taps and entry.taps != tuple(taps)):
                    continue
                if not torch.equal(entry.tokens[:n], tokens[:n]):  # a hash collision
                    continue
                self._entries.move_to_end(entry_id)
                self.hits += 1
                return entry, n
            self.misses += 1
        return None

    def store(self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
              taps: tuple = (), hidden: torch.Tensor | None = None, hashes: list[int] | None = None) -> None:
        """Keep the whole blocks of a prefilled prompt: ``keys`` / ``values`` per layer ``[kv_heads, >= n,
        head_dim]`` (views of the cache slot are fine: they are copied), ``hidden`` its taps ``[>= n, ...]``."""
        n = int(tokens.numel()) - int(tokens.numel()) % BLOCK
        if n == 0 or self.max_bytes <= 0:
            return
        hashes = block_hashes(tokens, n) if hashes is None else hashes
        with self._lock:
            known = self._entries.get(self._index.get(hashes[-1], -1))
            if known is not None and (known.taps == tuple(taps) or not taps) and int(known.tokens.numel()) >= n:
                self._entries.move_to_end(self._index[hashes[-1]])
                return
        entry = _Entry(tokens=tokens[:n].clone(), keys=[k[:, :n].clone() for k in keys],
                       values=[v[:, :n].clone() for v in values], taps=tuple(taps) if hidden is not None else (),
                       hidden=None if hidden is None else hidden[:n].clone(), hashes=hashes)
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            entry_id = next(self._ids)
            self._entries[entry_id] = entry
            self.nbytes += entry.nbytes
            for h in hashes:  # the newest entry serves every prefix it holds
                self._index[h] = entry_id
            while self.nbytes > self.max_bytes:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        entry_id, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        for h in entry.hashes:
            if self._index.get(h) == entry_id:
                del self._index[h]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self.nbytes = 0
