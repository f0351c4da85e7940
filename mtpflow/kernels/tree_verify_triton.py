"""Triton kernel for greedy tree verification: one program that finds the accepted root-to-node path from
the target's argmax rows with vector ops (first matching sibling, then pointer jumping over the parent links),
so the host reads one small buffer instead of walking the tree node by node."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def tree_path_kernel(argmax_ptr, tokens_ptr, parents_ptr, out_ptr, num_nodes,
                     BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr):
    """out[0] = path length, out[1] = next token, out[2] = ended on a leaf, out[3:3 + length] = path."""
    idx = tl.arange(0, BLOCK)
    valid = idx < num_nodes
    parent = tl.load(parents_ptr + idx, mask=valid, other=-2).to(tl.int32)
    token = tl.load(tokens_ptr + idx, mask=valid, other=-1)
    wanted = tl.load(argmax_ptr + (parent + 1), mask=valid, other=-2)
    match = valid & (token == wanted)
    # the gate takes the first matching child of a node, in node order
    earlier = (idx[None, :] < idx[:, None]) & (parent[None, :] == parent[:, None]) & match[None, :]
    good = match & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    # pointer jumping: after round r, ok covers the node and its 2^r - 1 nearest ancestors
    ok = good.to(tl.int32)
    up = tl.where(valid, parent, -1)
    for _ in tl.static_range(LOG_BLOCK):
        onehot = up[:, None] == idx[None, :]
        ok_up = tl.max(tl.where(onehot, ok[None, :], 0), axis=1)
        up_up = tl.sum(tl.where(onehot, up[None, :], 0), axis=1)
        has_up = up >= 0
        ok = tl.where(has_up, ok & ok_up, ok)
        up = tl.where(has_up, up_up, -1)
    on_path = (ok > 0) & valid
    length = tl.sum(on_path.to(tl.int32), axis=0)
    last = tl.max(tl.where(on_path, idx, -1), axis=0)
    next_token = tl.load(argmax_ptr + last + 1)
    has_child = tl.max((valid & (parent == last)).to(tl.int32), axis=0)
    leaf = (last >= 0) & (has_child == 0)
    rank = tl.cumsum(on_path.to(tl.int32), axis=0) - 1  # nodes come in topological order: rank = depth - 1
    tl.store(out_ptr + 3 + rank, idx.to(tl.int64), mask=on_path)
    tl.store(out_ptr, length.to(tl.int64))
    tl.store(out_ptr + 1, next_token.to(tl.int64))
    tl.store(out_ptr + 2, leaf.to(tl.int64))


def _block(n: int, low: int = 16) -> int:
    return max(low, triton.next_power_of_2(max(n, 1)))


def tree_path(target_argmax: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[3 + num_nodes] long buffer: length, next token, leaf flag, then the path's node indices."""
    n = int(tokens.numel())
    block = _block(n)
    out = torch.zeros(3 + n, dtype=torch.long, device=target_argmax.device)
    dev = target_argmax.device
    tree_path_kernel[(1,)](target_argmax.contiguous(), tokens.to(dev).contiguous(), parents.to(dev).contiguous(),
                           out, n, BLOCK=block, LOG_BLOCK=max(1, (block - 1).bit_length()))
    return out
