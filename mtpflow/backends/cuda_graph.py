"""The ``cuda_graph`` backend: verify forwards with static shapes, captured once per bucket and replayed.

A decode step of a small model on a GPU is bound by Python and kernel launches, not by the GPU. Here every
verify forward runs with fixed shapes: the batch padded to a bucket of sequences and each sequence's root plus
draft padded to a bucket of rows, over a KV pool preallocated at a fixed capacity, attention over the whole
capacity under a mask built from each sequence's length and tree (on the device, inside the forward). One
(batch, rows) bucket's forward is then always the same kernels on the same buffers: on CUDA it is captured once
in a ``torch.cuda.CUDAGraph`` and replayed every step (inputs copied into its static buffers). Prefill stays
uncaptured (prompts vary too much to bucket well).

The same static-shape code runs with graphs off (``graphs=False``, the default off CUDA): that is how CI tests it
on the CPU, token for token against HF, so everything but the capture is tested everywhere. Llama-family models
on SDPA only (the lean forward, ``mtpflow.forward``); the model's own modules compute every product.
"""
from __future__ import annotations

import time

import torch

from mtpflow import forward as lean_forward
from mtpflow.backends.base import Backend
from mtpflow.backends.execution import GRAPH_ROWS, check_graph_rows
from mtpflow.backends.hf import HFBackend, tree_allowed
from mtpflow.errors import UserError
from mtpflow.kv_cache import KVPool, write_rows
from mtpflow.types import Verification

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROW_BUCKETS = GRAPH_ROWS


def not_applicable(model) -> str | None:
    """Why the static-shape forward cannot run ``model`` (one line), or None."""
    if not lean_forward.supports(model):
        attn = getattr(model.config, "_attn_implementation", "?")
        return f"it runs Llama-family models on SDPA attention, not {type(model).__name__} on {attn}"
    return None


class _StaticCache:
    """The pool's buffers as one forward of a bucket sees them: rows ``0..B-1``, every position up to the
    capacity; row b's i-th new entry goes to ``lengths[b] + i`` (``write_rows``)."""

    def __init__(self, pool: KVPool, rows: torch.Tensor, positions: torch.Tensor):
        self.pool, self.rows, self.positions = pool, rows, positions

    def update(self, key, value, layer_idx: int):
        return write_rows(self.pool.keys[layer_idx], self.pool.values[layer_idx], self.rows, self.positions, key,
                          value, self.pool.capacity)


class _Bucket:
    """One (batch, rows) bucket: its static input buffers, and its graph once captured."""

    def __init__(self, backend: CUDAGraphBackend, batch: int, rows: int):
        dev = backend.device
        self.batch, self.rows = batch, rows
        self.ids = torch.zeros(batch, rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, rows, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=dev)
        self.allowed = torch.eye(rows, dtype=torch.bool, device=dev).repeat(batch, 1, 1)
        self.graph = None
        self.logits = None
        self.capture_seconds = 0.0

    def forward(self, backend: CUDAGraphBackend) -> torch.Tensor:
        """The bucket's verify forward on its static buffers: logits [batch, rows, vocab]."""
        pool, b, q = backend.pool, self.batch, self.rows
        dev = self.ids.device
        offsets = torch.arange(q, device=dev)
        write = self.lengths[:, None] + offsets[None]  # [B, q] where each new entry goes
        cols = torch.arange(pool.capacity, device=dev)
        rel = cols[None, None, :] - self.lengths[:, None, None]  # [B, 1, C] column - length
        own = self.allowed.gather(2, rel.clamp(0, q - 1).expand(b, q, pool.capacity))  # [B, q, C]
        visible = (rel < 0) | ((rel < q) & own)  # the cached prefix, and the row's own tree among the new entries
        mask = torch.zeros(b, 1, q, pool.capacity, dtype=backend.dtype, device=dev)
        mask.masked_fill_(~visible[:, None], torch.finfo(backend.dtype).min)
        cache = _StaticCache(pool, torch.arange(b, device=dev).repeat_interleave(q), write.reshape(-1))
        logits, _ = lean_forward.forward(backend.model, self.ids, self.positions, mask, cache)
        return logits

    def run(self, backend: CUDAGraphBackend) -> torch.Tensor:
        if not backend.graphs:
            return self.forward(backend)
        if self.graph is None:
            t0 = time.perf_counter()
            stream = torch.cuda.Stream(device=backend.device)
            stream.wait_stream(torch.cuda.current_stream(backend.device))
            with torch.cuda.stream(stream):  # warm-up outside the capture (allocator, cuBLAS handles)
                self.forward(backend)
            torch.cuda.current_stream(backend.device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.forward(backend)
            torch.cuda.synchronize(backend.device)
            self.capture_seconds = time.perf_counter() - t0
        self.graph.replay()
        return self.logits


class CUDAGraphBackend(Backend):
    """Static-shape verify forwards, CUDA-graph captured per bucket; see the module docstring. Prefills, and the
    verifies no bucket fits (named fallbacks), run the ``hf`` backend's dynamic shapes over the same pool."""

    name = "cuda_graph"

    def __init__(self, model, capacity: int = 2048, rows=ROW_BUCKETS, graphs: bool | None = None):
        super().__init__(model)
        self.dynamic = HFBackend(model)
        reason = not_applicable(model)
        if reason is not None:
            raise ValueError(reason)
        limit = int(getattr(model.config, "max_position_embeddings", 0) or capacity)
        self.capacity = min(int(capacity), limit)
        self.row_buckets = check_graph_rows(rows, self.capacity)
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise UserError("CUDA graphs need the model on a CUDA device (model.device=cuda)")
        self.pool: KVPool | None = None
        self._buckets: dict[tuple[int, int], _Bucket] = {}

    # ----- the KV pool: preallocated once, at a fixed capacity --------------------------------------------
    def make_pool(self, max_slots: int) -> KVPool:
        """The engine's KV pool: every buffer allocated now at ``capacity`` entries and never moved (graphs
        hold their addresses); batch buckets go up to ``max_slots``."""
        self.pool = KVPool(self.model, max_slots, fixed_capacity=self.capacity)
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_slots) + (max_slots,)
        return self.pool

    @property
    def context_limit(self) -> int:
        """Entries a sequence may hold: the capacity less the widest row bucket (its verify writes after them)."""
        return self.capacity - self.row_buckets[-1]

    # ----- verify -------------------------------------------------------------------------------------------
    def _bucket(self, batch: int, rows: int) -> _Bucket | None:
        b = next((x for x in self.batch_buckets if x >= batch), None)
        q = next((x for x in self.row_buckets if x >= rows), None)
        if b is None or q is None:
            return None
        if (b, q) not in self._buckets:
            self._buckets[(b, q)] = _Bucket(self, b, q)
        return self._buckets[(b, q)]

    @torch.inference_mode()
    def verify(self, targets, roots, drafts, root_positions):
        t0 = time.perf_counter()
        pool = targets[0].pool
        sizes = [1 + d.num_nodes for d in drafts]
        bucket = self._bucket(pool.used, max(sizes)) if pool is self.pool else None
        reason = ("no bucket fits" if bucket is None else "hidden states" if any(t.taps for t in targets)
                  else "past the capacity" if any(t.cache_len + bucket.rows > self.capacity for t in targets) else None)
        if reason is not None:  # dynamic shapes, uncaptured
            return self.fall_back(reason, self.dynamic.verify(targets, roots, drafts, root_positions))
        b, q = bucket.batch, bucket.rows
        ids = torch.zeros(b, q, dtype=torch.long)
        positions = torch.zeros(b, q, dtype=torch.long)
        lengths = torch.zeros(b, dtype=torch.long)
        allowed = torch.eye(q, dtype=torch.bool).repeat(b, 1, 1)  # padding rows see themselves only
        for owner in pool.owners:  # slots not verifying this step write their padding after their length
            lengths[owner.slot] = owner.length
        for target, root, draft, root_position, n in zip(targets, roots, drafts, root_positions, sizes):
            slot = target.kv.slot
            ids[slot, 0] = root
            ids[slot, 1:n] = draft.tokens
            base = root_position - target.position_shift
            positions[slot] = base
            if draft.num_nodes:
                positions[slot, 1:n] = base + draft.depths()
            allowed[slot, :n, :n] = tree_allowed(draft.parents)
        for buf, value in ((bucket.ids, ids), (bucket.positions, positions), (bucket.lengths, lengths),
                           (bucket.allowed, allowed)):
            buf.copy_(value, non_blocking=True)
        logits = bucket.run(self).float()
        seconds = time.perf_counter() - t0
        results = []
        for target, n in zip(targets, sizes):
            slot = target.kv.slot
            target.kv.length += n
            target.forwards += 1
            results.append(Verification(logits=logits[slot, :n], hidden=None, forward_seconds=seconds))
        return results

    def prefill(self, targets, prompts, prefix_cache=None, starts=None):
        return self.dynamic.prefill(targets, prompts, prefix_cache, starts)  # prompts vary too much to bucket

    def kernel_identity(self) -> str:
        return f"{'graphs' if self.graphs else 'no-graphs'} capacity {self.capacity}"

    def stats(self) -> dict:
        captured = [bk for bk in self._buckets.values() if bk.graph is not None]
        return {**super().stats(), "graphs_captured": len(captured),
                "graph_capture_seconds": round(sum(bk.capture_seconds for bk in captured), 3)}
