"""Shared fixtures: a tiny random Llama (fast) and the embedded default model (marked ``default_model``);
the helpers behind them live in ``tests/helpers.py``."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("MTPFLOW_LOAD_PLUGINS", "")  # tests load no third-party plugin unless they ask
torch.set_num_threads(min(2, os.cpu_count() or 1))

from helpers import tiny_loaded  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    """A tiny random Llama (2 layers, hidden 64) with a byte-level BPE tokenizer."""
    return tiny_loaded(seed=0)


@pytest.fixture(scope="session")
def default_loaded():
    """The embedded SmolLM2-135M-Instruct (converted once into the cache directory)."""
    from mtpflow.model import load_model

    return load_model("smollm2")
