"""Random inputs shared by the kernel tests: draft trees of many shapes (chains, stars, deep and bushy ones),
seeded so a failure names a reproducible case."""
from __future__ import annotations

import random

import torch

# where the Triton side of each comparison runs: compiled on CUDA, the interpreter on CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_parents(rng: random.Random, num_nodes: int) -> list[int]:
    """Parents in topological order for one of several tree shapes."""
    shape = rng.choice(["chain", "star", "random", "bushy"])
    parents: list[int] = []
    for i in range(num_nodes):
        if shape == "chain":
            parents.append(i - 1)
        elif shape == "star":
            parents.append(-1)
        elif shape == "bushy":
            parents.append(rng.randint(-1, min(i - 1, 2)))
        else:
            parents.append(rng.randint(-1, i - 1))
    return parents


def tree_allowed(parents: list[int]) -> torch.Tensor:
    """[num_nodes, num_nodes] bool: node i sees itself and its ancestors."""
    n = len(parents)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        allowed[i, i] = True
        if p >= 0:
            allowed[i] |= allowed[p]
    return allowed
