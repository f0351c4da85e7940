"""The ``mtpflow`` attention implementation for Hugging Face models: prefill and chain verify forwards
(no custom mask) run causal attention with the queries at the end of the keys, through flash-attn on CUDA
when it is installed; tree verify forwards (a 4D mask) run the tree attention kernel. With the kernels'
``torch`` implementation everything goes through PyTorch SDPA, exactly like ``attn_implementation=sdpa``.

Select it with ``model.attn_implementation=mtpflow`` (the default on CUDA when flash-attn is installed, since
HF's own flash_attention_2 cannot apply a tree mask); ``register()`` makes the name known to transformers.
"""
from __future__ import annotations

import importlib.util

import torch

from mtpflow.kernels.dispatch import resolve_impl
from mtpflow.kernels.tree_attention import causal_tail, full_mask, tree_attention

ATTENTION_NAME = "mtpflow"


def flash_attn_usable(query: torch.Tensor) -> bool:
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flash_attn") is not None)


def _sdpa(module, query, key, value, mask, dropout, scaling, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def mtpflow_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    """HF attention function: query [batch, heads, q_len, head_dim], key/value [batch, kv_heads, kv_len, d].
    Returns (output [batch, q_len, heads, head_dim], None)."""
    kwargs.pop("is_causal", None)
    batch, _, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    scale = head_dim**-0.5 if scaling is None else scaling
    impl = resolve_impl(None, query.device)
    if attention_mask is None:  # causal, the queries are the last q_len keys (see ``mtpflow_mask``)
        if impl == "triton" and flash_attn_usable(query):
            from flash_attn import flash_attn_func

            out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  softmax_scale=scale, causal=True)  # bottom-right aligned (flash-attn >= 2.1)
            return out, None
        allowed, prefix_len = causal_tail(batch, q_len, query.device), kv_len - q_len
        if impl == "torch":
            mask = None if q_len in (1, kv_len) else full_mask(allowed, prefix_len)[:, None]
            return _sdpa(module, query, key, value, mask, dropout, scale, is_causal=q_len == kv_len and q_len > 1)
    else:
        if impl == "torch":
            return _sdpa(module, query, key, value, attention_mask, dropout, scale, **kwargs)
        mask = attention_mask[:, 0]
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        prefix_len = 0
    out = tree_attention(query, key, value, allowed[..., -(kv_len - prefix_len):] if kv_len > prefix_len
                         else allowed[..., :0], prefix_len, scale, impl=impl)
    return out.transpose(1, 2).contiguous(), None


def mtpflow_mask(*args, **kwargs):
    """Mask builder: ``None`` (plain causal, handled in ``mtpflow_attention``) when there is no padding and
    no sliding window; otherwise SDPA's boolean mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if kwargs.get("attention_mask") is None and kwargs.get("mask_function") is causal_mask_function:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Make ``attn_implementation="mtpflow"`` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, mtpflow_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, mtpflow_mask)
    return ATTENTION_NAME
