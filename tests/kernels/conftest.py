"""Kernel tests run every Triton kernel on CPU through the Triton interpreter (compiled on a CUDA machine):
TRITON_INTERPRET must be set before any kernel module is imported (they are imported lazily, on the first
Triton dispatch); an explicit value in the environment wins.
"""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

