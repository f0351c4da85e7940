"""Draft-model proposer: a smaller causal LM with the same tokenizer drafts K tokens autoregressively on its
own KV cache. With ``layers: N`` and no model, the draft model is the target's own first N layers plus its
LM head (self-speculative, LayerSkip style), which needs no second model on disk."""
from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from mtpflow.errors import ConfigError, UserError
from mtpflow.hookspecs import hookimpl
from mtpflow.sampling import target_probs
from mtpflow.types import DecodeState, Draft


def truncated_model(model, layers: int):
    """A view of ``model`` that runs only its first ``layers`` decoder layers (weights shared, not copied)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise UserError("strategy.propose.layers needs a Llama-style model (model.model.layers)")
    if not 1 <= layers <= len(inner.layers):
        raise ConfigError(f"strategy.propose.layers must be in [1, {len(inner.layers)}], got {layers}")
    view = copy.copy(model)
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)
    view_inner._modules["layers"] = torch.nn.ModuleList(list(inner.layers)[:layers])
    view._modules = dict(model._modules)
    view._modules["model"] = view_inner
    view.config = copy.copy(model.config)
    view.config.num_hidden_layers = layers
    view_inner.config = view.config
    return view


class DraftModelProposer:
    def __init__(self, model: str | None = None, layers: int | None = None, dtype: str = "auto"):
        if model is None and layers is None:
            raise ConfigError("strategy.propose needs a draft model (model=<HF id or path>) or layers=<N>")
        self.model_name, self.layers, self.dtype = model, layers, dtype
        self.draft = None
        self.cache = None
        self.cached = 0  # committed tokens in the draft cache

    @hookimpl
    def on_run_start(self, context):
        if self.model_name:
            from mtpflow.model import load_model

            loaded = load_model(self.model_name, dtype=self.dtype, device=str(context.model.device))
            if loaded.model.config.vocab_size != context.model.config.vocab_size:
                raise UserError(f"draft model {self.model_name} has a different vocabulary from the target")
            self.draft = loaded.model
        else:
            self.draft = truncated_model(context.model, int(self.layers))
        self.cache = DynamicCache(config=self.draft.config)
        self.cached = 0
        return {"draft_model": self.model_name or f"target[:{self.layers} layers]"}

    @torch.inference_mode()
    def _forward(self, ids: list[int], start: int) -> torch.Tensor:
        dev = next(self.draft.parameters()).device
        out = self.draft(input_ids=torch.tensor([ids], device=dev),
                         position_ids=torch.arange(start, start + len(ids), device=dev)[None],
                         cache=self.cache, use_cache=True)
        return out.logits[0, -1].float().cpu()

    @hookimpl
    def propose(self, state: DecodeState, k: int) -> Draft:
        tokens = state.tokens.tolist()
        # The draft cache holds committed tokens only; catch up on everything committed since last time.
        logits = self._forward(tokens[self.cached :], self.cached)
        self.cached = len(tokens)
        drafted, dists = [], []
        rng = state.extras.get("rng")
        for i in range(k):
            if state.sampling.greedy:
                tok = int(logits.argmax())
            else:
                q = target_probs(logits, state.sampling)
                tok = int(torch.multinomial(q, 1, generator=rng))
                dists.append(q)
            drafted.append(tok)
            if i + 1 < k:
                logits = self._forward([tok], len(tokens) + i)
        drop = self.cache.get_seq_length() - self.cached
        if drop > 0:
            self.cache.crop(-drop)
        draft = Draft.chain(drafted, source="draft_model")
        if dists:
            from dataclasses import replace

            draft = replace(draft, dists=torch.stack(dists))
        return draft
