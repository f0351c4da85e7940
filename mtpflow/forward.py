"""A lean forward for Llama-family models: the same arithmetic as Hugging Face's, without its per-call glue.

Why: on a CPU a one-row decode step of the default model (SmolLM2-135M, 30 layers) spent about 16 ms in the
linears (reading the weights at close to memory speed) and about 8 ms in everything around them; much of that
is Python per layer and per call (output capture, kwarg-deprecation and config-default wrappers, the mask
builder, the attention-interface lookup), paid on every verify forward. This forward walks the model's own
modules layer by layer (its own norms, MLPs and rotary embedding; the attention block written out) and calls
the same operations in the same order, so the numbers are the ones HF's forward computes (tested: equal
logits and hidden states on tiny Llama models, identical greedy outputs); only the glue is gone. One
operation differs in how, not in what: attention over several query rows uses SDPA's own grouped-query
support instead of HF's copy of every key and value head (``repeat_kv``), which gave bit-identical outputs
and took 25-40% less time for 4-17 rows over 150-400 cached entries.

Inside ``cpu_linear.packed()`` each layer's query/key/value projections and its MLP's gate/up projections run as
one product each (``fuse_projections``: the parts' weights become views into one concatenated weight, so no
memory is added and HF's own forward keeps using the parts): the same sums per output, fewer and wider calls.

Verify forwards on a CPU go further: ``native_rows`` (the engine's batch, a sequence's own verify) runs every
layer in one call into the native kernels (``mtpflow_llama_rows`` in ``mtpflow/kernels/small_gemm.c``; docs/kernels.md),
where the model and the per-machine plan allow it.

Used by ``mtpflow.target`` (through ``run``) for every forward over the KV pool (prefill, a sequence's own
verify, the batch's verify) when ``supports(model)``: ``LlamaForCausalLM`` with SDPA attention, on any
device. Other architectures (Gemma 3, ...), or ``MTPFLOW_LEAN_FORWARD=0``, take ``model(...)`` as before.
"""
from __future__ import annotations

import ctypes
import functools
import inspect
import os
import sys
import threading

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mtpflow import kv_cache
from mtpflow.kernels import cpu_linear, native_linear
from mtpflow.kernels.certified_head import certified_logits

SUPPORTED = ("LlamaForCausalLM",)


def supports(model) -> bool:
    """Whether ``forward`` computes exactly what ``model(...)`` computes for this model."""
    if os.environ.get("MTPFLOW_LEAN_FORWARD", "1") == "0":
        return False
    cached = getattr(model, "_mtpflow_lean", None)
    if cached is not None:
        return cached
    ok = type(model).__name__ in SUPPORTED and _plain_llama(model)
    try:
        model._mtpflow_lean = ok
    except AttributeError:
        pass
    return ok


def _plain_llama(model) -> bool:
    cfg = model.config
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return False
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    if int(getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return False
    layers = list(inner.layers)
    return bool(layers) and all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers)


def hidden_taps(model, spec) -> tuple[int, ...]:
    """A strategy's ``needs_hidden_states`` -> which hidden states a forward returns, in order (concatenated on
    the last dimension): ``()`` none; ``-1`` the last hidden state after the final norm (``true``); ``i`` in
    ``0..L-2`` the output of decoder layer i (HF's ``hidden_states[i + 1]``; the last layer's is -1, normed).
    ``eagle3`` is EAGLE-3's low, middle and high layers (2, L // 2, L - 3 of L layers, clipped to 0..L-2 for
    tiny models); a list names the taps itself."""
    if spec is None or spec is False:
        return ()
    if spec is True:
        return (-1,)
    layers = int(getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "num_hidden_layers"))
    if isinstance(spec, str):
        if spec != "eagle3":
            raise ValueError(f"needs_hidden_states must be true, false, eagle3 or a list of layers, got {spec!r}")
        if layers < 2:
            return (-1,)
        return tuple(sorted({max(0, min(t, layers - 2)) for t in (2, layers // 2, layers - 3)}))
    taps = tuple(int(t) for t in spec)
    if not taps or any(t < -1 or t >= layers - 1 for t in taps):
        raise ValueError(f"needs_hidden_states layers must be -1 or 0..{layers - 2}, got {list(taps)}")
    return taps


def taps_of(need_hidden) -> tuple[int, ...]:
    """``need_hidden`` as a caller may pass it (False / True / a tuple of taps) -> a tuple of taps."""
    if isinstance(need_hidden, tuple):
        return need_hidden
    return (-1,) if need_hidden else ()


def _causal_mask(q: int, kv: int, device) -> torch.Tensor | None:
    """What HF's SDPA mask builder gives a padding-free batch: None where SDPA needs no mask (one query, or
    queries == keys: ``is_causal``), else a boolean [1, 1, q, kv] mask with the queries at the end."""
    if q == 1 or q == kv:
        return None
    rows = torch.arange(q, device=device)[:, None] + (kv - q)
    return (torch.arange(kv, device=device)[None, :] <= rows)[None, None]


def forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            cache, need_hidden=False, logits_to_keep: int = 0, layer=None, segments=None):
    """``model(input_ids, position_ids, attention_mask, cache=cache, use_cache=True)`` for a supported model.

    input_ids, position_ids: [B, q]; attention_mask: None (causal, queries after the cache) or the additive /
    boolean 4D mask [B, 1, q, kv] the caller built; cache: an HF ``Cache`` whose layers' ``update`` store the
    new keys and values (the pool views of ``mtpflow.kv_cache``); need_hidden: False, True or a tuple of taps
    (``hidden_taps``). Returns (logits [B, q or logits_to_keep, vocab], the taps concatenated
    [B, q, hidden * len(taps)] or None; True: the last hidden state after the final norm). The norms, the
    MLPs and the rotary embedding are the model's own modules and functions; only the attention block is
    written out (``decoder_layer``). ``layer``: a stand-in for ``decoder_layer`` with its signature (the
    compiled one of ``mtpflow.compiled``, given the pool's buffers instead of ``cache``). ``segments``: see
    ``forward_packed``."""
    inner = model.model
    if layer is None and getattr(model, "_mtpflow_fused", None) is None and cpu_linear.active():
        fuse_projections(model)
    apply_rotary = sys.modules[type(inner.layers[0].self_attn).__module__].apply_rotary_pos_emb
    h = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(h, position_ids=position_ids)
    b, q = input_ids.shape
    taps = taps_of(need_hidden)
    tapped = {}
    mask = attention_mask
    if mask is None and q > 1 and segments is None:  # every layer holds as many entries: one mask serves them all
        mask = _causal_mask(q, cache.get_seq_length() + q, h.device)
    for index, block in enumerate(inner.layers[: model.config.num_hidden_layers]):
        if segments is not None:
            own = [(start, end, functools.partial(c.update, layer_idx=index)) for start, end, c in segments]
            h = decoder_layer(block, h, cos, sin, None, None, apply_rotary, segments=own)
        elif layer is None:
            h = decoder_layer(block, h, cos, sin, mask, functools.partial(cache.update, layer_idx=index),
                              apply_rotary)
        else:
            h = layer(block, index, h, cos, sin, mask, apply_rotary)
        if index in taps:
            tapped[index] = h
    h = inner.norm(h)
    tapped[-1] = h
    if segments is not None:  # each sequence's last row
        kept = h[:, [end - 1 for _, end, _ in segments]]
    else:
        kept = h[:, -logits_to_keep:] if logits_to_keep else h
    return model.lm_head(kept), _concat_taps(tapped, taps)


def forward_packed(model, input_ids: list[torch.Tensor], position_ids: list[torch.Tensor], caches: list,
                   need_hidden=False):
    """Several sequences' prefills in ONE forward of a supported model: their prompts' rows one after another
    (no padding), so every product runs once over all the rows (a wide product: on a CPU about 2.0 ms per
    prompt token from ~100 rows on against 2.9 for a 40-token prompt alone); attention runs per sequence over
    its own cache, causal, as its prefill alone would (``decoder_layer``'s ``segments``). Sequence i feeds
    ``input_ids[i]`` at ``position_ids[i]`` (1-D) into ``caches[i]`` (a batch-1 ``Cache``, the pool's
    ``SlotCache``). Returns (logits [n, vocab] of each sequence's last row, each sequence's taps [len, ...] or
    None)."""
    counts = [int(t.numel()) for t in input_ids]
    ends = torch.tensor(counts).cumsum(0).tolist()
    segments = [(end - n, end, cache) for n, end, cache in zip(counts, ends, caches)]
    logits, hidden = forward(model, torch.cat(input_ids)[None], torch.cat(position_ids)[None], None, None,
                             need_hidden, segments=segments)
    taps = None if hidden is None else [hidden[0, start:end] for start, end, _ in segments]
    return logits[0], taps


def decoder_layer(block, h, cos, sin, mask, update, apply_rotary, compiled: bool = False, segments=None):
    """One decoder layer (HF's ``LlamaDecoderLayer`` arithmetic, in its order): ``update(key, value)`` stores
    the new entries and returns the layer's keys and values to attend to. ``compiled=True`` (the
    compiled forward) attends through ``grouped_attention``, the same for any row count. ``segments``
    (``forward_packed``): the rows are several sequences' prompts one after another, ``(start, end, update)``
    each; the products run over all rows at once, attention per sequence (its own cache, causal)."""
    attn = block.self_attn
    b, q = h.shape[:2]
    residual = h
    x = block.input_layernorm(h)
    shape = (b, q, -1, attn.head_dim)
    qkv = None if compiled else attn.__dict__.get("_mtpflow_qkv")
    if qkv is not None and qkv.ready():
        query, key, value = (y.view(shape).transpose(1, 2) for y in qkv.split(x))
    else:
        query = attn.q_proj(x).view(shape).transpose(1, 2)
        key = attn.k_proj(x).view(shape).transpose(1, 2)
        value = attn.v_proj(x).view(shape).transpose(1, 2)
    query, key = apply_rotary(query, key, cos, sin)
    if segments is None:
        key, value = update(key, value)
        out = _attend(attn, query, key, value, mask, compiled)
    else:  # each sequence attends to its own cache: what its prefill alone computes, row for row
        parts = []
        for start, end, own_update in segments:
            k, v = own_update(key[:, :, start:end], value[:, :, start:end])
            parts.append(_attend(attn, query[:, :, start:end], k, v,
                                 _causal_mask(end - start, int(k.shape[2]), h.device), False))
        out = torch.cat(parts, dim=1)
    h = residual + attn.o_proj(out.reshape(b, q, -1).contiguous())
    x = block.post_attention_layernorm(h)
    mlp = block.mlp
    gate_up = None if compiled else mlp.__dict__.get("_mtpflow_gate_up")
    if gate_up is not None and gate_up.ready():  # LlamaMLP's arithmetic over the fused product
        gate, up = gate_up.split(x)
        return h + mlp.down_proj(mlp.act_fn(gate) * up)
    return h + mlp(x)



def _attend(attn, query, key, value, mask, compiled: bool) -> torch.Tensor:
    """Attention of one decoder layer: query [b, H, q, d] over key / value [b, Hkv, kv, d] -> [b, q, H, d]."""
    q = query.shape[2]
    if compiled:
        return grouped_attention(query, key, value, mask, attn.scaling)
    if getattr(attn, "num_key_value_groups", 1) > 1 and (q > 1 or mask is None):
        # several query rows (a prefill, a chain, a tree): SDPA's own GQA instead of HF's repeat_kv copy of
        # the keys and values (bit-identical here, 25-40% less time for 4-17 rows over 150-400 entries); one
        # row without a mask (a sequence's plain step): the call HF's SDPA wrapper makes, without the wrapper
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0,
                                             is_causal=mask is None and q > 1, scale=attn.scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    out, _ = sdpa_attention_forward(attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling)
    return out


_FUSE_LOCK = threading.Lock()


def fuse_projections(model) -> int:
    """Give each decoder layer of a supported model fused query/key/value and gate/up products
    (``cpu_linear.fuse``: the parts' weights become views into the fused one, no extra memory) that
    ``decoder_layer`` uses inside ``cpu_linear.packed()``; once per model (``forward`` calls it), and only where
    the linears are PackedLinears (``cpu_linear.install`` ran). Kept out of the module tree (no new parameters,
    the state dict unchanged). Returns how many fused products exist."""
    with _FUSE_LOCK:
        done = getattr(model, "_mtpflow_fused", None)
        if done is not None:
            return done
        count = 0
        for block in model.model.layers:
            for module, names, attr in ((block.self_attn, ("q_proj", "k_proj", "v_proj"), "_mtpflow_qkv"),
                                        (block.mlp, ("gate_proj", "up_proj"), "_mtpflow_gate_up")):
                fused = cpu_linear.fuse([getattr(module, n, None) for n in names])
                if fused is not None:
                    object.__setattr__(module, attr, fused)  # not a submodule: no parameters, no state-dict keys
                    count += 1
        try:
            model._mtpflow_fused = count
        except AttributeError:
            pass
        return count


# ----- new tokens through native code: every layer in one call ---------------------------------------------

class _RowSpec:
    """What ``native_rows`` gives ``mtpflow_llama_rows`` (small_gemm.c) for one model: its dimensions, the weights'
    pointer arrays, and what to check before each call that the weights are still the ones pointed at."""

    def __init__(self, model):
        cfg = model.config
        inner = model.model
        layers = list(inner.layers[: cfg.num_hidden_layers])
        first = layers[0].self_attn
        self.dims = (len(layers), int(cfg.hidden_size), int(cfg.num_attention_heads), int(cfg.num_key_value_heads),
                     int(first.head_dim), int(cfg.intermediate_size))
        self.eps, self.scale = float(inner.norm.variance_epsilon), float(first.scaling)
        self.norm = inner.norm.weight
        fused = [m for block in layers for m in (block.self_attn._mtpflow_qkv, block.mlp._mtpflow_gate_up)]
        plain = [m for block in layers for m in (block.input_layernorm, block.self_attn.o_proj,
                                                 block.post_attention_layernorm, block.mlp.down_proj)] + [inner.norm]
        # every module whose weight the kernel reads (a fused product's parts are views into its weight), with
        # where that weight lay when the spec was built: ``ready`` compares them before each call
        self.watched = [(m.__dict__, m._parameters, m._parameters["weight"].data_ptr())
                        for m in plain + [part for f in fused for part in f._mtpflow_parts]]
        self.probe = first.o_proj
        # the products in the kernel's order: fused q/k/v, o_proj, fused gate/up, down_proj
        self.linears = [[block.self_attn._mtpflow_qkv for block in layers],
                        [block.self_attn.o_proj for block in layers],
                        [block.mlp._mtpflow_gate_up for block in layers], [block.mlp.down_proj for block in layers]]
        qkv, o, gu, down = (_pointers([m.weight for m in ms]) for ms in self.linears)
        self.weights = (_pointers([b.input_layernorm.weight for b in layers]), qkv, o,
                        _pointers([b.post_attention_layernorm.weight for b in layers]), gu, down)
        self._kv = (None, None, None)  # (the pool's key list, key pointers, value pointers)
        self._panels = None  # (the weights' versions, the panel pointer arrays)
        self._q8 = None  # (the weights' versions, int8 copies, their pointer arrays): ``int8`` builds it

    def int8(self):
        """The 8 pointer arrays (int8 weights, scales; per product) of an int8 copy of the four products, built on
        first use (``native_linear.quantize_int8``, one scale per output feature) and again when a weight changed
        in place: what ``draft_rows`` runs. The default model's copy: 106.8 MB."""
        versions = tuple(m._parameters["weight"]._version for ms in self.linears for m in ms)
        if self._q8 is None or self._q8[0] != versions:
            copies = [[native_linear.quantize_int8(m.weight) for m in ms] for ms in self.linears]
            pointers = tuple(p for cs in copies for p in (_pointers([q for q, _ in cs]), _pointers([s for _, s in cs])))
            self._q8 = (versions, copies, pointers)
        return self._q8[2]

    @property
    def int8_bytes(self) -> int:
        """Bytes held by the int8 copy (0 before ``int8`` built it)."""
        if self._q8 is None:
            return 0
        return sum(q.numel() + 4 * s.numel() for cs in self._q8[1] for q, s in cs)

    def ready(self, rows: int, plan: bool = True) -> bool:
        """The weights are still those pointed at (none replaced or quantized) and ``rows`` rows run native.
        A verify wider than 17 rows (a big tree, a batch of drafts) follows the 17-row plan: the widest bucket is
        timed as a prefill, whose layers run in Python, where oneDNN's products may win by a hair (a 64-token
        prefill timed native 127.4 ms against oneDNN 123.1), while one native call for every layer only gains
        with more rows (17 rows: native 33.0 ms against oneDNN 60.0)."""
        plans = self.probe._mtpflow_row_paths
        if plan and plans[min(cpu_linear.bucket(rows), cpu_linear.WIDEST_VERIFY_BUCKET)] != "native":
            return False
        for attrs, params, ptr in self.watched:  # the dicts read directly, not through nn.Module's getattr
            if params["weight"].data_ptr() != ptr or attrs.get("_mtpflow_int8") is not None:
                return False
        return True

    def panels(self, rows: int):
        """Pointer arrays to each product's panel copy (built on first use, as the native linear builds them)
        from ``native_linear.panel_min_rows()`` rows, else NULLs."""
        if rows < native_linear.panel_min_rows():
            return (None,) * 4
        # rebuilt only when a weight changed in place (its version; a replaced weight fails ``ready``): asking
        # every linear for its panels took 0.4-0.5 ms, on every batched step
        versions = tuple(m._parameters["weight"]._version for ms in self.linears for m in ms)
        if self._panels is None or self._panels[0] != versions:
            self._panels = (versions, tuple(_pointers([m._panels() for m in ms]) for ms in self.linears))
        return self._panels[1]

    def kv(self, pool):
        """Pointer arrays to every layer's key and value buffer (rebuilt when the pool grows)."""
        keys, k, v = self._kv
        if keys is not pool.keys:
            k, v = _pointers(pool.keys), _pointers(pool.values)
            self._kv = (pool.keys, k, v)
        return k, v


def _pointers(tensors):
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def _row_spec(model) -> _RowSpec | None:
    """The model's ``_RowSpec``, built once; None where ``mtpflow_llama_rows`` does not compute what the model does
    (a norm, activation or rotary other than Llama's, biases, fused products missing, non-float32 weights)."""
    spec = model.__dict__.get("_mtpflow_row_spec", False)
    if spec is not False:
        return spec
    spec = None
    try:
        inner = model.model
        layers = list(inner.layers[: model.config.num_hidden_layers])
        llama = "transformers.models.llama.modeling_llama"
        norms = [inner.norm] + [n for b in layers for n in (b.input_layernorm, b.post_attention_layernorm)]
        linears = [m for b in layers for m in (b.self_attn._mtpflow_qkv, b.self_attn.o_proj, b.mlp._mtpflow_gate_up,
                                               b.mlp.down_proj)]
        ok = (getattr(model.config, "hidden_act", None) == "silu"
              and all(type(b.self_attn).__module__ == llama and type(b.mlp).__module__ == llama for b in layers)
              and all(type(n).__name__ == "LlamaRMSNorm"
                      and float(n.variance_epsilon) == float(inner.norm.variance_epsilon) for n in norms)
              and all(m.bias is None and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
                      and m.weight.is_contiguous() for m in linears)
              and all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in norms)
              and layers[0].self_attn.head_dim % 2 == 0
              and model.config.num_attention_heads % model.config.num_key_value_heads == 0)
        spec = _RowSpec(model) if ok else None
    except (AttributeError, TypeError):
        spec = None
    model.__dict__["_mtpflow_row_spec"] = spec
    return spec


def native_for(model, rows: int, plan: bool = True):
    """(the kernels, the model's spec) where ``rows`` new tokens may go through ``mtpflow_llama_rows``, else None:
    outside ``cpu_linear.packed()``, no native kernels, ``MTPFLOW_NATIVE_ROW=0``, a model ``_row_spec`` turns
    down, or a plan for that many rows that is not native (``plan=False``: whatever the plan, for the int8 draft,
    which has no float32 alternative to lose to)."""
    if not cpu_linear.active() or not native_linear.rows_enabled() or not supports(model) \
            or not getattr(model, "_mtpflow_fused", None):
        return None
    lib = native_linear.library()
    spec = _row_spec(model) if lib is not None else None
    if spec is None or not spec.ready(rows, plan):
        return None
    return lib, spec


def _run_rows(model, lib, spec, pool, ids, positions, slots, wpos, prefix, first, count, allowed,
              argmax_only=False, int8=False):
    """``mtpflow_llama_rows`` over the rows described (lists of ints, one entry per row; ``allowed`` a uint8
    [rows, qmax] tensor): returns the LM head's logits [1, rows, vocab] and the normed last hidden states.
    ``argmax_only``: the caller reads only each row's argmax, so the LM head may take the certified int8 path
    (``mtpflow.kernels.certified_head``). ``int8``: the products through the int8 copy (``_RowSpec.int8``)."""
    pool.ensure(max(w + 1 for w in wpos))  # the pool has the weights' dtype and device: float32, CPU (_row_spec)
    keys, values = spec.kv(pool)
    inner = model.model
    h = inner.embed_tokens(ids).contiguous()
    cos, sin = (t.contiguous() for t in inner.rotary_emb(h, position_ids=positions))
    normed = torch.empty_like(h)
    ints = [torch.tensor(v, dtype=torch.int32) for v in (slots, wpos, prefix, first, count)]
    m = len(slots)
    panels, int8_copy = ((None,) * 4, spec.int8()) if int8 else (spec.panels(m), (None,) * 8)
    if lib.mtpflow_llama_rows(h.data_ptr(), normed.data_ptr(), m, *spec.dims, *spec.weights, *panels,
                              spec.norm.data_ptr(), spec.eps, keys, values, pool.capacity,
                              *[t.data_ptr() for t in ints], allowed.data_ptr(), allowed.shape[1], cos.data_ptr(),
                              sin.data_ptr(), spec.scale, torch.get_num_threads(), *int8_copy) != 0:
        raise MemoryError("mtpflow_llama_rows: out of memory")
    return (certified_logits(model, normed) if argmax_only else model.lm_head(normed)), normed


def native_rows(model, pool, slots: list[int], lengths: list[int], ids: list[torch.Tensor],
                positions: list[torch.Tensor], allowed: list[torch.Tensor], native=None, argmax_only=False):
    """A verify forward (``target.verify_batch``, ``Target.verify``) through ``mtpflow_llama_rows``: sequence i
    (pool slot ``slots[i]``, ``lengths[i]`` entries) feeds ``ids[i]`` at rope ``positions[i]``, written at its
    length on, row j seeing its prefix and the new entries ``allowed[i][j]`` marks. Only real rows are computed
    (no padding). Returns (logits [rows, vocab], normed hidden [rows, hidden], each sequence's first row), or
    None where it does not apply (``native_for``; a caller that checked first passes what it returned).
    ``argmax_only``: every sequence reads only its rows' argmax (``Target.argmax_only``): the certified head."""
    counts = [int(t.numel()) for t in ids]
    m = sum(counts)
    native = native if native is not None else native_for(model, m)
    if native is None:
        return None
    mask = torch.zeros(m, max(counts), dtype=torch.uint8)
    row_slots, wpos, prefix, first, count, starts = [], [], [], [], [], []
    start = 0
    for slot, length, n, a in zip(slots, lengths, counts, allowed):
        mask[start:start + n, :n] = a
        row_slots += [slot] * n
        wpos += range(length, length + n)
        prefix += [length] * n
        first += [start] * n
        count += [n] * n
        starts.append(start)
        start += n
    logits, normed = _run_rows(model, *native, pool, torch.cat(ids)[None], torch.cat(positions)[None], row_slots,
                               wpos, prefix, first, count, mask, argmax_only)
    return logits[0], normed[0], starts


def draft_rows(model, pool, slot: int, length: int, root: int, position: int, steps: int) -> list[int] | None:
    """``steps`` greedy tokens after ``root`` from the target's own layers with int8 weights (``_RowSpec.int8``):
    one row per token through ``mtpflow_llama_rows`` over pool slot ``slot``, whose first ``length`` entries (the
    committed tokens, written by the float32 verify forwards) every row attends to; the draft's own entries go
    after them, where the next verify forward overwrites them. ``position``: the root's rope position. The LM head
    is the certified one (its argmax is the float32 head's over these hidden states). None where the native
    forward does not apply (``native_for``)."""
    native = native_for(model, 1, plan=False)
    if native is None:
        return None
    one = torch.ones(1, 1, dtype=torch.uint8)
    token, drafted = root, []
    for i in range(steps):
        logits, _ = _run_rows(model, *native, pool, torch.tensor([[token]]), torch.tensor([[position + i]]), [slot],
                              [length + i], [length + i], [0], [1], one, argmax_only=True, int8=True)
        token = int(logits[0, -1].argmax())
        drafted.append(token)
    return drafted


def grouped_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """Attention written out for the compiled forward (Inductor fuses the mask, softmax and scaling; its lowering
    of SDPA's CPU kernel wants strides a view into the KV pool does not have): query [B, H, q, d], key and value
    [B, Hkv, kv, d] (H a multiple of Hkv, grouped-query), additive mask [B, 1, q, kv]. Returns [B, q, H, d]."""
    b, heads, q, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scores = query.reshape(b, kv_heads, groups * q, d) @ key.transpose(-1, -2) * scale  # [B, Hkv, G * q, kv]
    scores = scores.view(b, kv_heads, groups, q, -1) + mask[:, :, None]
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype).view(b, kv_heads, groups * q, -1)
    return (probs @ value).view(b, heads, q, d).transpose(1, 2)


def _concat_taps(tapped: dict, taps: tuple[int, ...]):
    if not taps:
        return None
    if len(taps) == 1:
        return tapped[taps[0]]
    return torch.cat([tapped[t] for t in taps], dim=-1)


@functools.lru_cache(maxsize=None)
def _forward_takes(cls: type, name: str) -> bool:
    try:
        return name in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def run(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache,
        need_hidden=False, logits_to_keep: int = 0):
    """One forward over a KV-pool cache, as (logits, the hidden-state taps or None): ``forward`` where the model
    is supported, else the model's own forward (``logits_to_keep`` where it takes it, else every row's)."""
    if supports(model):
        if getattr(model, "_mtpflow_compiled", None) is not None:
            from mtpflow import compiled

            out = compiled.run(model, input_ids, position_ids, attention_mask, cache, taps_of(need_hidden))
            if out is not None:
                return out
        return forward(model, input_ids, position_ids, attention_mask, cache, need_hidden, logits_to_keep)
    takes_keep = logits_to_keep and _forward_takes(type(model), "logits_to_keep")
    extra = {"logits_to_keep": logits_to_keep} if takes_keep else {}
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                use_cache=True, output_hidden_states=bool(need_hidden), **extra)
    if not need_hidden:
        return out.logits, None
    # hidden_states[0] is the embeddings, [i + 1] decoder layer i's output, [-1] the output after the final norm
    states = out.hidden_states
    taps = taps_of(need_hidden)
    return out.logits, _concat_taps({t: states[-1] if t == -1 else states[t + 1] for t in taps}, taps)
