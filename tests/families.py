"""Tiny random models of every family the native layer description knows (``mtpflow.backends.native.description``),
each built in code from its transformers config class by ``mtpflow.tools.family_bench`` (the benchmark of the same
models): several layers, grouped-query attention, and where the family has one a sliding window (``WINDOW``)
shorter than the tests' contexts (the prompts of ``strategy_sweep`` plus their new tokens). Import with
``from families import ...``."""
from __future__ import annotations

import torch

from mtpflow.tools.family_bench import FAMILIES, WINDOW, make_family_model as _make

__all__ = ["FAMILIES", "WINDOW", "family_loaded", "make_family_model"]


def make_family_model(family: str, vocab: int = 320, seed: int = 0):
    """A tiny random model of ``family`` (float32, eval mode; EOS and pad token 0)."""
    model = _make(family, vocab, seed)
    model.generation_config.eos_token_id = 0
    return model


def family_loaded(family: str, seed: int = 0):
    """``make_family_model`` with the tiny tokenizer, as ``load_model`` returns a model."""
    from helpers import make_tiny_tokenizer
    from mtpflow.model import LoadedModel

    tok = make_tiny_tokenizer()
    model = make_family_model(family, len(tok), seed)
    return LoadedModel(model, tok, f"tiny-{family}-{seed}", torch.device("cpu"), torch.float32, 512, (0,))
