"""A lean forward for Llama-family models: the same arithmetic as Hugging Face's, without its per-call glue.

Why: on a CPU much of a small model's decode step went to Python glue around the products (output capture,
kwarg-deprecation and config-default wrappers, the mask builder, the attention-interface lookup), paid on every
verify forward. This forward walks the model's own modules layer by layer (its own norms, MLPs and rotary
embedding; the attention block written out) and calls the same operations in the same order, so the numbers
are the ones HF's forward computes (tested: equal logits and hidden states on tiny Llama models, identical
greedy outputs); only the glue is gone. One operation differs in how, not in what: attention over several query
rows uses SDPA's own grouped-query support instead of HF's copy of every key and value head (``repeat_kv``),
which gives bit-identical outputs in less time.

The linear products go through a ``Products`` object: ``MODULE_PRODUCTS`` calls the model's own modules (the
``hf`` backend); a backend may pass its own (``mtpflow.backends.native_cpu``: fused, native or int8 products
over copies it owns) without touching the model. Pure torch, any device; used by the backends for every forward
over the KV pool when ``supports(model)``: ``LlamaForCausalLM`` with SDPA attention. Other architectures
(Gemma 3, ...), or a backend built with ``model.lean_forward=false``, take ``model(...)`` (``run``).
"""
from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SUPPORTED = ("LlamaForCausalLM",)


def supports(model) -> bool:
    """Whether ``forward`` computes exactly what ``model(...)`` computes for this model."""
    return type(model).__name__ in SUPPORTED and _plain_llama(model)


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


class Products:
    """The linear products of one forward, by layer: the model's own modules (HF's arithmetic, any device). A
    backend passes a subclass whose products run elsewhere (fused, native, int8) with the same results."""

    def attention_inputs(self, index: int, attn, x: torch.Tensor):
        """(query, key, value) projections of layer ``index`` over ``x`` [b, q, hidden]."""
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    def attention_output(self, index: int, attn, x: torch.Tensor) -> torch.Tensor:
        return attn.o_proj(x)

    def mlp(self, index: int, mlp, x: torch.Tensor) -> torch.Tensor:
        return mlp(x)

    def head(self, model, h: torch.Tensor) -> torch.Tensor:
        return model.lm_head(h)


MODULE_PRODUCTS = Products()


def forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            cache, need_hidden=False, logits_to_keep: int = 0, segments=None,
            products: Products = MODULE_PRODUCTS):
    """``model(input_ids, position_ids, attention_mask, cache=cache, use_cache=True)`` for a supported model.

    input_ids, position_ids: [B, q]; attention_mask: None (causal, queries after the cache) or the additive /
    boolean 4D mask [B, 1, q, kv] the caller built; cache: an HF ``Cache`` whose layers' ``update`` store the
    new keys and values (the pool views of ``mtpflow.kv_cache``); need_hidden: False, True or a tuple of taps
    (``mtpflow.types.hidden_taps``). Returns (logits [B, q or logits_to_keep, vocab], the taps concatenated
    [B, q, hidden * len(taps)] or None; True: the last hidden state after the final norm). The norms and the
    rotary embedding are the model's own modules and functions; only the attention block is written out
    (``decoder_layer``); the products are ``products``'. ``segments``: see ``forward_packed``."""
    inner = model.model
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
            h = decoder_layer(block, index, h, cos, sin, None, None, apply_rotary, products, segments=own)
        else:
            h = decoder_layer(block, index, h, cos, sin, mask, functools.partial(cache.update, layer_idx=index),
                              apply_rotary, products)
        if index in taps:
            tapped[index] = h
    h = inner.norm(h)
    tapped[-1] = h
    if segments is not None:  # each sequence's last row
        kept = h[:, [end - 1 for _, end, _ in segments]]
    else:
        kept = h[:, -logits_to_keep:] if logits_to_keep else h
    return products.head(model, kept), _concat_taps(tapped, taps)


def forward_packed(model, input_ids: list[torch.Tensor], position_ids: list[torch.Tensor], caches: list,
                   need_hidden=False, products: Products = MODULE_PRODUCTS):
    """Several sequences' prefills in ONE forward of a supported model: their prompts' rows one after another
    (no padding), so every product runs once over all the rows (wide products use the hardware better than
    several narrow ones); attention runs per sequence over its own cache, causal, as its prefill alone would
    (``decoder_layer``'s ``segments``). Sequence i feeds ``input_ids[i]`` at ``position_ids[i]`` (1-D) into
    ``caches[i]`` (a batch-1 ``Cache``, the pool's ``SlotCache``). Returns (logits [n, vocab] of each
    sequence's last row, each sequence's taps [len, ...] or None)."""
    counts = [int(t.numel()) for t in input_ids]
    ends = torch.tensor(counts).cumsum(0).tolist()
    segments = [(end - n, end, cache) for n, end, cache in zip(counts, ends, caches)]
    logits, hidden = forward(model, torch.cat(input_ids)[None], torch.cat(position_ids)[None], None, None,
                             need_hidden, segments=segments, products=products)
    taps = None if hidden is None else [hidden[0, start:end] for start, end, _ in segments]
    return logits[0], taps


def decoder_layer(block, index: int, h, cos, sin, mask, update, apply_rotary, products: Products = MODULE_PRODUCTS,
                  segments=None):
    """Decoder layer ``index`` (HF's ``LlamaDecoderLayer`` arithmetic, in its order): ``update(key, value)``
    stores the new entries and returns the layer's keys and values to attend to. ``segments``
    (``forward_packed``): the rows are several sequences' prompts one after another, ``(start, end, update)``
    each; the products run over all rows at once, attention per sequence (its own cache, causal)."""
    attn = block.self_attn
    b, q = h.shape[:2]
    residual = h
    x = block.input_layernorm(h)
    shape = (b, q, -1, attn.head_dim)
    query, key, value = (y.view(shape).transpose(1, 2) for y in products.attention_inputs(index, attn, x))
    query, key = apply_rotary(query, key, cos, sin)
    if segments is None:
        key, value = update(key, value)
        out = _attend(attn, query, key, value, mask)
    else:  # each sequence attends to its own cache: what its prefill alone computes, row for row
        parts = []
        for start, end, own_update in segments:
            k, v = own_update(key[:, :, start:end], value[:, :, start:end])
            parts.append(_attend(attn, query[:, :, start:end], k, v,
                                 _causal_mask(end - start, int(k.shape[2]), h.device)))
        out = torch.cat(parts, dim=1)
    h = residual + products.attention_output(index, attn, out.reshape(b, q, -1).contiguous())
    x = block.post_attention_layernorm(h)
    return h + products.mlp(index, block.mlp, x)


def _attend(attn, query, key, value, mask) -> torch.Tensor:
    """Attention of one decoder layer: query [b, H, q, d] over key / value [b, Hkv, kv, d] -> [b, q, H, d]."""
    q = query.shape[2]
    if getattr(attn, "num_key_value_groups", 1) > 1 and (q > 1 or mask is None):
        # several query rows (a prefill, a chain, a tree): SDPA's own GQA instead of HF's repeat_kv copy of
        # the keys and values (bit-identical, less time); one row without a mask (a sequence's plain step):
        # the call HF's SDPA wrapper makes, without the wrapper
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0,
                                             is_causal=mask is None and q > 1, scale=attn.scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    out, _ = sdpa_attention_forward(attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling)
    return out


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
        need_hidden=False, logits_to_keep: int = 0, products: Products = MODULE_PRODUCTS, lean: bool = True):
    """One forward over a KV-pool cache, as (logits, the hidden-state taps or None): ``forward`` where the model
    is supported (and ``lean``), else the model's own forward (``logits_to_keep`` where it takes it, else every
    row's)."""
    if lean and supports(model):
        return forward(model, input_ids, position_ids, attention_mask, cache, need_hidden, logits_to_keep,
                       products=products)
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
