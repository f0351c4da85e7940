"""Preallocated KV caches for every running sequence, written in place by position (as gpt-fast does).

``KVPool`` holds one key and one value buffer per layer, ``[slots, kv_heads, capacity, head_dim]``: each
running sequence owns one slot (row) and its entries sit at positions ``0..length-1`` of that row. A forward
writes its new entries after ``length``; rolling a rejected draft back is setting ``length`` back (nothing to
free or copy), and keeping an accepted tree path is a gather inside the row.

Two Hugging Face ``Cache`` views sit on the pool:
- ``SlotCache``: one sequence (batch 1), for its prefill, a self-draft on the target's own layers, or a
  plugin's own verify forward. Per-layer lengths, like ``DynamicCache``, so code that runs only some layers
  (the self-draft) and crops them back works unchanged.
- ``BatchCache``: rows ``0..B-1`` at once, for the engine's one verify forward per step; row ``b`` writes its
  ``q`` new entries at ``lengths[b]..lengths[b]+q-1`` and attention reads ``[:B, :, :max(lengths)+q]`` (a view:
  no per-step concatenation). The engine's 4D mask hides each row's padding and other rows' lengths.

Running sequences occupy slots ``0..n-1`` (``release`` moves the last one into the freed slot), so a batch
forward never gathers rows. Capacity grows by doubling when a sequence needs more room, and drops back when
the pool empties, so memory follows the longest running sequence, not the model's context.
"""
from __future__ import annotations

import threading

import torch
from transformers.cache_utils import Cache, DynamicLayer

MIN_CAPACITY = 256


class KVPool:
    """Key/value buffers for up to ``max_slots`` sequences of one model."""

    def __init__(self, model, max_slots: int, fixed_capacity: int | None = None,
                 entry_dtype: torch.dtype | None = None, entry_width: int | None = None):
        cfg = model.config
        cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        self.num_layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        # how a key or value entry (one token, one key / value head) is held: head_dim values of the model's dtype by
        # default; a backend with its own layout names it (the int8 model: head_dim int8 values, then their float32
        # scale: head_dim + 4 bytes). Every copy of entries below (slots, growth, the tree's gather, the prefix
        # cache) moves whole entries, whatever they hold.
        self.entry_dtype = entry_dtype or self.dtype
        self.entry_width = int(entry_width or self.head_dim)
        self.max_slots = int(max_slots)
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.owners: list[object] = []  # the SequenceKV in each used slot, in slot order
        self.lock = threading.Lock()
        # a pool allocated once at this capacity and never moved (a backend that captures CUDA graphs holds
        # the buffers' addresses); None: grow by doubling, free when empty
        self.fixed_capacity = fixed_capacity
        if fixed_capacity is not None:
            self._allocate(int(fixed_capacity))

    # ----- slots --------------------------------------------------------------------------------------------
    def acquire(self, owner) -> int:
        with self.lock:
            if len(self.owners) >= self.max_slots:
                raise RuntimeError("KV pool is full")  # the engine never admits more than max_slots sequences
            self.owners.append(owner)
            return len(self.owners) - 1

    @torch.inference_mode()
    def release(self, slot: int) -> None:
        """Free ``slot``; the sequence in the last slot moves into it (one row copy), keeping slots dense."""
        with self.lock:
            last = len(self.owners) - 1
            if slot != last:
                moved = self.owners[last]
                n = moved.capacity_used()
                for buf in (*self.keys, *self.values):
                    buf[slot, :, :n] = buf[last, :, :n]
                self.owners[slot] = moved
                moved.slot = slot
            self.owners.pop()
            if not self.owners and self.fixed_capacity is None:  # give the memory back between bursts
                self.keys, self.values, self.capacity = [], [], 0

    @property
    def used(self) -> int:
        return len(self.owners)

    @torch.inference_mode()
    def ensure(self, length: int) -> None:
        """Grow every buffer so a row can hold ``length`` entries (doubling; existing entries are copied)."""
        if length <= self.capacity:
            return
        with self.lock:
            if length <= self.capacity:
                return
            if self.fixed_capacity is not None:
                raise RuntimeError(f"KV pool: {length} entries asked of a fixed capacity of {self.capacity}")
            new = max(MIN_CAPACITY, self.capacity)
            while new < length:
                new *= 2
            self._allocate(new)

    @torch.inference_mode()
    def _allocate(self, new: int) -> None:
        """Buffers of ``new`` entries per slot, the entries held so far copied in."""
        shape = (self.max_slots, self.kv_heads, new, self.entry_width)
        keys = [torch.zeros(shape, dtype=self.entry_dtype, device=self.device) for _ in range(self.num_layers)]
        values = [torch.zeros(shape, dtype=self.entry_dtype, device=self.device) for _ in range(self.num_layers)]
        if self.capacity:
            for old, fresh in zip(self.keys + self.values, keys + values):
                fresh[:, :, : self.capacity] = old
        self.keys, self.values, self.capacity = keys, values, new

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def token_bytes(self) -> int:
        """The bytes one token's keys and values take, every layer and key / value head."""
        itemsize = torch.empty(0, dtype=self.entry_dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.entry_width * itemsize


class SequenceKV:
    """One sequence's place in the pool: its slot and its length (entries 0..length-1 are valid)."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.length = 0
        self.slot = pool.acquire(self)
        self._view: SlotCache | None = None

    def capacity_used(self) -> int:
        view_max = max((layer.length for layer in self._view.layers), default=0) if self._view else 0
        return max(self.length, view_max)

    def release(self) -> None:
        if self.slot >= 0:
            self.pool.release(self.slot)
            self.slot = -1

    def view(self) -> SlotCache:
        """A batch-1 HF cache over this sequence's row, its per-layer lengths set to ``length``."""
        if self._view is None:
            self._view = SlotCache(self)
        for layer in self._view.layers:
            layer.length = self.length
        return self._view

    def gather(self, start: int, index: torch.Tensor) -> None:
        """Move the entries at ``index`` (ascending, >= start) to ``start, start+1, ...`` in every layer."""
        src = index.to(self.pool.device)
        n = int(src.numel())
        row = self.slot
        for buf in (*self.pool.keys, *self.pool.values):
            buf[row, :, start : start + n] = buf[row].index_select(1, src)

    def keys(self, layer: int) -> torch.Tensor:
        return self.pool.keys[layer][self.slot : self.slot + 1, :, : self.length]

    def set_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the row's first ``keys.shape[-2]`` entries of one layer (sliding-window eviction)."""
        n = int(keys.shape[-2])
        self.pool.keys[layer][self.slot, :, :n] = keys[0]
        self.pool.values[layer][self.slot, :, :n] = values[0]


class SlotLayer(DynamicLayer):
    """One layer of a ``SlotCache``: appends at its own length, returns a view of the row."""

    is_croppable = True

    def __init__(self, seq: SequenceKV, layer_idx: int):
        super().__init__()
        self.seq, self.layer_idx, self.length = seq, layer_idx, 0
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers live in the pool
        pass

    # this layer's slice of the pool's buffers; assigning is a no-op (DynamicLayer.__init__ assigns None; the pool
    # owns the storage)
    keys = property(lambda self: self._pool_slice("keys"), lambda self, value: None)
    values = property(lambda self: self._pool_slice("values"), lambda self, value: None)

    def _pool_slice(self, buffers: str):
        if getattr(self, "seq", None) is None:
            return None
        pool = self.seq.pool
        layers = getattr(pool, buffers)
        return layers[self.layer_idx][self.seq.slot : self.seq.slot + 1, :, : self.length] if layers else None

    def update(self, key_states, value_states, *args, **kwargs):
        q = int(key_states.shape[-2])
        end = self.length + q
        pool, row = self.seq.pool, self.seq.slot
        pool.ensure(end)
        pool.keys[self.layer_idx][row, :, self.length : end] = key_states[0]
        pool.values[self.layer_idx][row, :, self.length : end] = value_states[0]
        self.length = end
        return (pool.keys[self.layer_idx][row : row + 1, :, :end], pool.values[self.layer_idx][row : row + 1, :, :end])

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of entries to drop")
        self.length = max(0, self.length + tokens_to_remove)


class SlotCache(Cache):
    """A batch-1 HF cache over one sequence's row of the pool."""

    def __init__(self, seq: SequenceKV):
        super().__init__(layers=[SlotLayer(seq, i) for i in range(seq.pool.num_layers)])
        self.seq = seq


class BatchLayer(DynamicLayer):
    """One layer of a ``BatchCache``: scatters each row's new entries at its own length."""

    def __init__(self, cache: BatchCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        c = self.cache
        return write_rows(c.pool.keys[self.layer_idx], c.pool.values[self.layer_idx], c.row_index, c.position_index,
                          key_states, value_states, c.kv_length)

    def get_seq_length(self) -> int:
        return self.cache.kv_length - self.cache.query_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.kv_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a batch view is rolled back through each sequence's length")


def write_rows(keys, values, rows, positions, key_states, value_states, kv_length):
    """One layer's batched write: entry ``i`` of the new keys / values ([B, heads, q, d], flattened row-major
    over B and q) goes to row ``rows[i]`` at ``positions[i]`` of the buffers ([slots, heads, capacity, d]);
    returns what attention reads, rows ``0..B-1`` up to ``kv_length`` (views, no copy)."""
    b, h, q, d = key_states.shape
    keys[rows, :, positions] = key_states.transpose(1, 2).reshape(b * q, h, d)
    values[rows, :, positions] = value_states.transpose(1, 2).reshape(b * q, h, d)
    return keys[:b, :, :kv_length], values[:b, :, :kv_length]


class BatchCache(Cache):
    """Rows ``0..B-1`` of the pool for one forward of ``query_length`` tokens per row; row b writes at
    ``lengths[b]``. The caller sets each sequence's new length afterwards."""

    def __init__(self, pool: KVPool, lengths: list[int], query_length: int):
        self.pool = pool
        self.query_length = int(query_length)
        self.kv_length = max(lengths) + self.query_length
        pool.ensure(self.kv_length)
        b = len(lengths)
        offsets = torch.arange(self.query_length)
        base = torch.tensor(lengths, dtype=torch.long)
        self.row_index = torch.arange(b).repeat_interleave(self.query_length).to(pool.device)  # [B * q]
        self.position_index = (base[:, None] + offsets[None]).reshape(-1).to(pool.device)  # [B * q]
        super().__init__(layers=[BatchLayer(self, i) for i in range(pool.num_layers)])
