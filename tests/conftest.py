"""Shared fixtures: a tiny random Llama (fast) and the embedded default model (marked ``default_model``);
the helpers behind them live in ``tests/helpers.py``."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("MTPFLOW_LOAD_PLUGINS", "")  # tests load no third-party plugin unless they ask
torch.set_num_threads(min(2, os.cpu_count() or 1))

from helpers import tiny_loaded  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def temporary_cache(tmp_path_factory):
    """Measurements (verify costs, CPU linear plans, native builds), traces and chat history of the whole session,
    subprocesses included, go to a temporary folder, never the user's cache. Only converted models are shared
    (``models/`` links to the user's cache): they are inputs, and converting the default model takes a minute."""
    from mtpflow.model import cache_dir

    user_models = cache_dir() / "models"
    root = tmp_path_factory.mktemp("mtpflow-cache")
    try:
        user_models.mkdir(parents=True, exist_ok=True)
        (root / "models").symlink_to(user_models, target_is_directory=True)
    except OSError:  # a read-only home: models are converted into the temporary folder
        pass
    previous = os.environ.get("MTPFLOW_CACHE")
    os.environ["MTPFLOW_CACHE"] = str(root)
    yield root
    if previous is None:
        os.environ.pop("MTPFLOW_CACHE", None)
    else:
        os.environ["MTPFLOW_CACHE"] = previous


@pytest.fixture(scope="session")
def tiny():
    """A tiny random Llama (2 layers, hidden 64) with a byte-level BPE tokenizer."""
    return tiny_loaded(seed=0)


@pytest.fixture(scope="session")
def default_loaded():
    """The embedded SmolLM2-135M-Instruct (converted once into the cache directory)."""
    from mtpflow.model import load_model

    return load_model("smollm2")
