"""The int8 model on the CPU (``model.quantize=int8``): the ``native_cpu`` backend over int8 weights.

At batch 1 a CPU decode step is bound by reading the weights; int8 weights are a quarter of float32's bytes, and
with the activations quantized per row the dot products run on the CPU's integer units (AVX-512 VNNI, else
AVX2; ``mtpflow_w8a8_rows`` in rows_int8.c, the products in gemm.c). The numerics are
``mtpflow.backends.native.int8_reference``'s, which defines the int8 model: "lossless" here means token-identical to its
greedy, one token at a time, and every forward below computes exactly that model row by row (no result depends
on the other rows in the call).

``quantize_model`` builds the int8 weights at load time and frees the float32 weights of the decoder layers and
the LM head (a model that fits in int8 but not in float32 runs); an embedding table of its own stays float32 (one
row read per token); one tied to the head is read from the int8 head's rows. Every forward of this backend goes
through the C kernel: prefills (in chunks of ``rows.PREFILL_ROWS`` rows), verifies (with the hidden-state taps a
strategy asks for) and the self-draft.
"""
from __future__ import annotations

import ctypes
import gc
import time

import torch

from mtpflow.backends.base import Backend
from mtpflow.backends.native import kernel, openmp
from mtpflow.backends.native.head_products import HeadProduct
from mtpflow.backends.native.memory import huge_page_bytes
from mtpflow.backends.native.int8_reference import (Int8Linear, Int8Weights, quantize_model as int8_model,
                                                  quantize_rows, softcap)
from mtpflow.backends.native.rows import (VerifyRows, call_members, one_row, optional, prefill_through,
                                          tap_outputs, verify_through)
from mtpflow.backends.native.threads import GOVERNOR
from mtpflow.errors import UserError
from mtpflow.kv_cache import KVPool

# the weights an int8 model is made from: a model too large for the memory in float32 loads in bfloat16
# (model.dtype=bfloat16) and is quantized layer by layer
SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Int8Rows(torch.nn.Module):
    """The int8 LM head of the int8 model in the model's place (and, where the head is tied to it, its input
    embedding, times the model's embedding scale where it has one): ``forward(ids)`` looks rows up, ``weight`` is
    the float table ``q * scale`` made on each read (a draft head's vocabulary projection, a vocabulary size). The
    model's own forward does not run any more."""

    def __init__(self, head: Int8Linear, embed_scale: float | None = None):
        super().__init__()
        self.head = head
        self.embed_scale = embed_scale
        self.num_embeddings = self.out_features = head.n
        self.embedding_dim = self.in_features = head.k

    @property
    def weight(self) -> torch.Tensor:
        return self.head.dequantized()

    def select(self, ids: torch.Tensor) -> torch.Tensor:
        """The float rows ``ids`` [len(ids), hidden] (``q * scale`` of those rows only)."""
        return self.head.dequantized(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.head.dequantized(ids)
        if self.embed_scale is not None:
            rows = rows * torch.tensor(self.embed_scale, dtype=rows.dtype)
        return rows.view(*ids.shape, -1)


def quantize_model(model, reason: str | None) -> Int8Weights:
    """``model`` as the int8 model: its int8 weights, with the float32 weights of its decoder layers and LM head
    (and of its embedding, where the head is tied to it) freed: their linears keep empty weights, the head (and
    tied embedding) become ``Int8Rows`` over the int8 head. ``reason``: why the ``native_cpu`` backend cannot run
    ``model`` (``native_cpu.not_applicable``), a one-line UserError then."""
    if reason is not None:
        raise UserError(f"model.quantize=int8 does not apply to this model: {reason}")
    def release(module) -> None:  # each layer's float weights go as soon as its int8 ones exist
        for m in module.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    inner = model.model
    weights = int8_model(model, release)
    with torch.no_grad():
        rows = Int8Rows(weights.head)
        model.lm_head = rows
        if weights.embed is None:  # tied (one module where the embedding is not scaled)
            inner.embed_tokens = rows if weights.embed_scale is None else Int8Rows(weights.head, weights.embed_scale)
        model.float()  # what is left (norms, an embedding of its own) as the int8 model reads it: float32
    _return_freed_memory()
    return weights


def _return_freed_memory() -> None:
    """Hand the freed float weights' pages back to the system (glibc keeps freed heap memory otherwise: the
    process would stay as large as the float model)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class NativeInt8Backend(Backend):
    """Every forward of the int8 model through ``mtpflow_w8a8_rows``; see the module docstring."""

    name = "native_cpu"

    def __init__(self, model, weights: Int8Weights):
        super().__init__(model)
        self.lib = kernel.library()
        if self.lib is None:
            raise ValueError("mtpflow's C kernel could not be built here (no C compiler: set CC, or install cc/gcc)")
        self.w = w = weights
        layers = w.layers
        lin = {name: [getattr(layer, name) for layer in layers] for name in ("qkv", "o", "gate_up", "down")}
        self._arrays = {"ln1": kernel.pointers([layer.ln1 for layer in layers]),
                        "ln2": kernel.pointers([layer.ln2 for layer in layers])}
        for key, name in (("qkv", "qkv"), ("o", "o"), ("gu", "gate_up"), ("d", "down")):
            self._arrays["w" + key] = kernel.pointers([x.q for x in lin[name]])
            self._arrays["s" + key] = kernel.pointers([x.scale for x in lin[name]])
            self._arrays["z" + key] = kernel.pointers([x.wsum for x in lin[name]])
        for key, name in (("post_attn", "post_attention"), ("post_mlp", "post_mlp"), ("qn", "q_norm"),
                          ("kn", "k_norm"), ("bqkv", "bqkv"), ("bo", "bo"), ("bgu", "bgu"), ("bd", "bd")):
            self._arrays[key] = optional([getattr(layer, name) for layer in layers])
        windows = [layer.window for layer in layers]
        self._window = torch.tensor(windows, dtype=torch.int32) if any(windows) else None
        self._rope_keys = [layer.rope for layer in layers]
        first = layers[0]
        self._dims = dict(L=len(layers), H=w.hidden, nh=w.heads, nkv=w.kv_heads, d=w.head_dim, I=w.intermediate,
                          kp_h=first.qkv.kp, kp_q=first.o.kp, kp_i=first.down.kp, rot=w.rotary_dims, act=w.activation,
                          softcap=w.attn_softcap, eps=w.eps, scale=w.attn_scale)
        self.kv = kernel.PoolPointers()
        self._huge_mb = None
        # whether the thread governor watches this backend's forwards (``threads.GOVERNOR``); a draft model's backend
        # runs on the count the target's forwards decide: its forwards, interleaved with the target's and slower
        # right after them, made the governor take a quiet machine for a shared one (measured:
        # docs/bench/step_dec07.md)
        self.governed = True
        # the input embeddings of recent tokens, for a head tied to the embedding (``_embedding``)
        self._embedded: dict[int, torch.Tensor] = {}

    # a verify's or a draft step's few rows take their embeddings from here: the int8 head's row times its scale
    # is seven torch operations over the packed layout on every forward (measured: docs/bench/step_dec07d.md); a
    # prompt's chunk (more rows) computes its own. At most EMBED_CACHE tokens are kept (each H floats), then it
    # starts over.
    EMBED_ROWS, EMBED_CACHE = 32, 4096

    def _embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """``Int8Weights.embedding`` of ``ids`` as a new contiguous tensor [len(ids), H] (the kernel writes into it),
        the same values: a tied head's dequantized rows are computed once per token and kept (``EMBED_CACHE``)."""
        if self.w.embed is not None or ids.numel() > self.EMBED_ROWS:
            return self.w.embedding(ids).contiguous()
        cache, tokens = self._embedded, ids.reshape(-1).tolist()
        missing = [t for t in dict.fromkeys(tokens) if t not in cache]
        if missing:
            if len(cache) + len(missing) > self.EMBED_CACHE:
                cache.clear()
            for t, row in zip(missing, self.w.embedding(torch.tensor(missing, dtype=torch.long))):
                cache[t] = row
        return torch.stack([cache[t] for t in tokens])

    def make_pool(self, max_slots: int):
        """The int8 model's KV pool: each key and value entry its head_dim int8 values, then their float32 scale (the
        kernel's ENTRY_BYTES)."""
        return KVPool(self.model, max_slots, entry_dtype=torch.int8, entry_width=self.w.head_dim + 4)

    @torch.inference_mode()
    def write_entries(self, pool, slot: int, start: int, keys, values) -> None:
        """Float keys and values of the same model (per layer [key / value heads, n, head_dim], the keys rotated:
        another backend's cache of these tokens) into ``pool``'s ``slot`` at entries ``start`` .. ``start + n - 1``,
        each quantized as the kernel quantizes its own (``int8_reference.quantize_rows``: int8 values, then the float32
        scale). A layer's keys and values go through one quantization (its float copies are the only scratch)."""
        n = int(keys[0].shape[-2])
        pool.ensure(start + n)
        for layer, (k, v) in enumerate(zip(keys, values)):
            q, scale = quantize_rows(torch.stack([k, v]).float())  # [2, heads, n, d]
            entries = torch.cat([q.to(torch.int8), scale[..., None].contiguous().view(torch.int8)], -1)
            pool.keys[layer][slot, :, start:start + n] = entries[0]
            pool.values[layer][slot, :, start:start + n] = entries[1]

    # ----- the kernel ---------------------------------------------------------------------------------------
    def run(self, pool, rows: VerifyRows, taps=(), head_from: int | None = 0, layers: int | None = None):
        """``mtpflow_w8a8_rows`` over ``rows`` (``verify_rows``, ``prefill_rows``), the int8 LM head in the same call.
        Returns (the logits [rows - head_from, vocab] of rows ``head_from`` on, soft-capped where the model caps them,
        None where ``head_from`` is None; the taps [rows, H * len(taps)] or None: layer outputs, -1 the final-normed
        state). ``layers``: the first ``layers`` layers only, then the final norm and the head."""
        h = self._embedding(rows.ids)
        normed = torch.empty_like(h)
        members, tapped, held = call_members(rows, self.w.rope, self._rope_keys, taps, h)
        m = members["M"]
        logits = None if head_from is None else torch.empty(m - head_from, self.w.head.n)
        threads, start = GOVERNOR.threads(forward=self.governed), time.perf_counter()
        code = kernel.w8a8_rows(self.lib, **self._members(pool, rows, members, h, normed, logits, head_from, layers,
                                                          threads))
        if self.governed:
            GOVERNOR.observe(self, m, time.perf_counter() - start, threads, kind=layers)
        if code != 0:
            raise MemoryError("mtpflow_w8a8_rows: out of memory")
        del held
        if logits is not None:
            logits = softcap(logits, self.w.logit_softcap)
        return logits, tap_outputs(tapped, normed, taps)

    def _members(self, pool, rows: VerifyRows, members: dict, h, normed, logits, head_from, layers, threads) -> dict:
        """``W8A8Args``' members for ``rows`` over ``pool`` (grown to hold their entries): ``call_members``' and the
        model's, the buffers h, normed and logits (None: no head)."""
        if pool.entry_dtype != torch.int8 or pool.entry_width != self.w.head_dim + 4:
            raise ValueError("the int8 model's forwards take its own KV pool (NativeInt8Backend.make_pool)")
        pool.ensure(max(w + 1 for w in rows.wpos))
        keys, values = self.kv(pool)
        head = self.w.head
        return dict(h=h.data_ptr(), normed=normed.data_ptr(), **members,
                    **{**self._dims, "L": layers or self._dims["L"]}, **self._arrays, norm_w=self.w.norm.data_ptr(),
                    window=None if self._window is None else self._window.data_ptr(), kc=keys, vc=values,
                    cap=pool.capacity, threads=threads, head_q=head.q.data_ptr(), head_s=head.scale.data_ptr(),
                    head_z=head.wsum.data_ptr(), vocab=head.n, head_from=head_from or 0,
                    logits=None if logits is None else logits.data_ptr())

    def greedy(self, target, root: int, position: int, steps: int, layers: int | None = None) -> list[int]:
        """``self_draft``'s tokens in one native call (``mtpflow_w8a8_greedy``: the steps' one-row forwards, each
        token's embedding and argmax in C). Where the model soft-caps its logits, one ``run`` per token (tanh's
        rounding can tie what the raw logits order, and torch's argmax then takes the first)."""
        if self.w.logit_softcap:
            return self.greedy_per_token(target, root, position, steps, layers)
        length, slot = target.cache_len, target.kv.slot
        rows = VerifyRows(torch.zeros(steps, dtype=torch.long), torch.arange(position, position + steps),
                          torch.ones(steps, 1, dtype=torch.uint8), [slot] * steps, list(range(length, length + steps)),
                          list(range(length, length + steps)), [0] * steps, [1] * steps, [0], [1])
        h, normed, logits = torch.empty(1, self.w.hidden), torch.empty(1, self.w.hidden), torch.empty(1, self.w.head.n)
        members, _, held = call_members(rows, self.w.rope, self._rope_keys, (), h)
        out = torch.empty(steps, dtype=torch.int32)
        threads, start = GOVERNOR.threads(forward=self.governed), time.perf_counter()
        embed = self.w.embed
        code = kernel.w8a8_greedy(self.lib, steps, int(root), out.data_ptr(),
                                  None if embed is None else embed.data_ptr(), float(self.w.embed_scale or 0.0),
                                  **self._members(target.pool, rows, members, h, normed, logits, 0, layers, threads))
        if self.governed:
            GOVERNOR.observe(self, 1, (time.perf_counter() - start) / steps, threads, kind=layers)
        del held
        if code != 0:
            raise MemoryError("mtpflow_w8a8_greedy: out of memory")
        return out.tolist()

    def greedy_per_token(self, target, root: int, position: int, steps: int, layers: int | None = None) -> list[int]:
        """``greedy``'s tokens through one ``run`` and one torch argmax per token (soft-capped logits; the reference
        the native loop is tested and timed against)."""
        length, token, drafted = target.cache_len, root, []
        for i in range(steps):
            logits, _ = self.run(target.pool, one_row(token, position + i, target.kv.slot, length + i), layers=layers)
            token = int(logits[0].argmax())
            drafted.append(token)
        return drafted

    # ----- the interface ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, targets, prompts, prefix_cache=None, starts=None):
        return prefill_through(lambda pool, rows, taps, last: self.run(pool, rows, taps, head_from=last), targets,
                               prompts, starts)

    @torch.inference_mode()
    def verify(self, targets, roots, drafts, root_positions):
        return verify_through(self.run, targets, roots, drafts, root_positions)

    drafts_layers = True

    @torch.inference_mode()
    def self_draft(self, target, root, position, steps, layers=None):
        """``steps`` greedy tokens of the int8 model itself (or its first ``layers`` layers, the final norm and
        the head: ``draft_model``'s layer-skip draft), one row per token over the target's slot (the entries go
        after the committed ones, where the next verify overwrites them). Over all layers there is no cheaper copy:
        the draft is the target's own greedy, always accepted, at one forward per token."""
        return self.greedy(target, root, position, steps, layers) if steps > 0 else []

    def kernel_identity(self) -> str:
        return f"w8a8 {kernel.q8_isa(self.lib)} kernel:{kernel.source_hash()[:10]}"

    def describe(self) -> str:
        return f"{self.name} {self.device} int8 {self.kernel_identity()}"  # the float32 left (norms) is no dtype

    def thread_idle(self) -> None:
        openmp.release_workers()

    def stats(self) -> dict:
        if self._huge_mb is None:  # the weights were all written at load: what lies on huge pages is known by now
            held = 0 if self.w.buffer is None else huge_page_bytes(self.w.buffer)
            self._huge_mb = round(held / 2**20, 1)
        return {**super().stats(), "int8_weights_mb": round(self.w.nbytes / 2**20, 1),
                "int8_weights_huge_pages_mb": self._huge_mb}

    def head_product(self, weight, bias=None, int8=False):
        """A draft head's linear through the native products (``head_products.HeadProduct``)."""
        return HeadProduct(weight, bias, int8, self.lib)
