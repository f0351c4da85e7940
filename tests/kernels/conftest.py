"""Kernel tests run every Triton kernel on CPU through the Triton interpreter (compiled on a CUDA machine):
TRITON_INTERPRET must be set before any kernel module is imported (they are imported lazily, on the first
Triton dispatch); an explicit value in the environment wins.

Test modules across the suite do ``from conftest import ...``; once this file is imported it is the module
named ``conftest``, so it re-exports the root conftest's helpers (not its fixtures) to keep those imports
working whatever order pytest collects folders in.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

_spec = importlib.util.spec_from_file_location("_mtpflow_tests_root_conftest", Path(__file__).parents[1] / "conftest.py")
_root = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_root)
TINY_CORPUS = _root.TINY_CORPUS
hf_greedy = _root.hf_greedy
make_pipeline = _root.make_pipeline
make_tiny_model = _root.make_tiny_model
make_tiny_tokenizer = _root.make_tiny_tokenizer
tiny_loaded = _root.tiny_loaded
