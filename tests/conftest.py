"""Shared fixtures: a temporary cache, the fixed tuning profile, a tiny random Llama (fast) and the embedded
default model (marked ``default_model``); the helpers behind them live in ``tests/helpers.py``."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MTPFLOW_LOAD_PLUGINS", "")  # tests load no third-party plugin unless they ask
os.environ.setdefault("MTPFLOW_ADAPT_THREADS", "0")  # the thread count stays torch's: references and kernels alike
torch.set_num_threads(min(2, os.cpu_count() or 1))

from helpers import tiny_loaded  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def temporary_cache(tmp_path_factory):
    """Native builds, traces, chat history and any default-location profile of the whole session,
    subprocesses included, go to a temporary folder, never the user's cache. Only converted models are shared
    (``models/`` links to the user's cache): they are inputs, and converting the default model takes a minute."""
    from mtpflow.machine import cache_dir

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


FIXTURE_PROFILE = Path(__file__).parent / "fixtures" / "profile.json"


@pytest.fixture(scope="session", autouse=True)
def fixed_profile(tmp_path_factory):
    """Every cost the session's runs read (subprocesses included) comes from a fixed profile, never from timing
    this host: a per-session copy of ``tests/fixtures/profile.json`` (``"cpu": "*"``, a ``default`` entry for
    every key), so a test that writes an entry leaves the checkout alone. Tests of tuning name their own."""
    from mtpflow.host import PROFILE_ENV

    path = tmp_path_factory.mktemp("mtpflow-profile") / "profile.json"
    shutil.copyfile(FIXTURE_PROFILE, path)
    previous = os.environ.get(PROFILE_ENV)
    os.environ[PROFILE_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(PROFILE_ENV, None)
    else:
        os.environ[PROFILE_ENV] = previous


@pytest.fixture(scope="session")
def tiny():
    """A tiny random Llama (2 layers, hidden 64) with a byte-level BPE tokenizer."""
    return tiny_loaded(seed=0)


@pytest.fixture(scope="session")
def default_loaded():
    """The embedded SmolLM2-135M-Instruct (converted once into the cache directory)."""
    from mtpflow.model import load_model

    return load_model("smollm2")
