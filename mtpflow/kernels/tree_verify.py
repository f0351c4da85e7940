"""Greedy tree verification: the target's argmax after every node, and the longest root-to-node path whose
tokens all equal the target's own choice. The pure-torch reference sits beside the dispatchers that route to
the Triton kernels in ``tree_verify_triton`` (same contract, exact same outputs)."""
from __future__ import annotations

import torch

from mtpflow.kernels.dispatch import resolve_impl


def children_lists(parents: list[int]) -> tuple[list[int], list[list[int]]]:
    """(children of the root, children of each node) from a parent list (-1 = root), in node order."""
    root: list[int] = []
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        (root if p < 0 else kids[p]).append(i)
    return root, kids


def greedy_tree_verify_reference(
    target_argmax: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor
) -> tuple[torch.Tensor, int, bool]:
    """Longest accepted path under greedy exact match.

    target_argmax: [1 + num_nodes] the target's choice after the root (row 0) and after each node (row i+1).
    tokens, parents: [num_nodes] the draft tree (parents -1 for children of the root, topological order).
    Returns (accepted node indices [n_accepted] in depth order, the next token, whether the path ended on a
    leaf, i.e. the next token is a bonus rather than a recovery).
    """
    want = target_argmax.tolist()
    toks = tokens.tolist()
    root, kids = children_lists(parents.tolist())
    path: list[int] = []
    row, options = 0, root
    while options:
        match = next((c for c in options if toks[c] == want[row]), None)
        if match is None:
            return torch.tensor(path, dtype=torch.long), want[row], False
        path.append(match)
        row, options = match + 1, kids[match]
    return torch.tensor(path, dtype=torch.long), want[row], bool(path)


def _unpack(buffer: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    values = buffer.tolist()  # the one host read of the step
    length, next_token, leaf = values[:3]
    return torch.tensor(values[3 : 3 + length], dtype=torch.long), int(next_token), bool(leaf)


def greedy_tree_verify(target_argmax: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       impl: str | None = None) -> tuple[torch.Tensor, int, bool]:
    """Dispatcher for ``greedy_tree_verify_reference`` (same arguments and result). An empty draft (every step
    without drafting) has nothing to walk: the root's argmax, on any device."""
    if tokens.numel() == 0:
        return torch.zeros(0, dtype=torch.long), int(target_argmax[0]), False
    if resolve_impl(impl, target_argmax.device) == "torch":
        return greedy_tree_verify_reference(target_argmax, tokens, parents)
    from mtpflow.kernels.tree_verify_triton import tree_path

    return _unpack(tree_path(target_argmax, tokens, parents))
