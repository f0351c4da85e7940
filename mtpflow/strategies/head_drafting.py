"""Draft heads at decoding time: the trained modules of ``head_modules`` run as a few products of the engine's
backend (``Backend.head_product``: the native row, panel or int8 kernels on a CPU) and a handful of torch ops over
the rows of one drafting step, never as torch modules.

Why: a drafting step multiplies one to a few rows by weights of a few MB, where a torch module's linears read the
weight slower than the native kernels and each module call adds Python overhead (docs/heads.md#drafting-cost has
the profile). Medusa's K residual heads become ONE product (their weights stacked) and one draft-vocabulary
product; an EAGLE level is five products and one attention over the committed keys plus the tree's own.
``int8``: the draft's products in int8 (W8A8 where the backend has it): lossless verification makes a draft's
precision a trade of acceptance for speed, never a change of what the target emits.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from mtpflow.strategies.head_modules import (
    Eagle3Drafter, EagleDrafter, MedusaHeads, apply_rotary, rms_norm, rotary_freqs,
)


class RotaryTable:
    """cos / sin [positions, head_dim / 2] of ``head_modules.rotate`` (theta 10000), made in chunks of positions as
    they are needed: a drafting level rotates a few rows at one position, where computing the angles each time cost
    more than the rotation."""

    STEP = 256

    def __init__(self, head_dim: int, device: torch.device, theta: float = 10000.0):
        self.freqs = rotary_freqs(head_dim, device, theta)
        self.cos = self.sin = torch.empty(0, head_dim // 2, device=device)

    def at(self, positions: torch.Tensor, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim / 2] at positions [T] (none above ``last``): what ``apply_rotary`` takes to do
        ``head_modules.rotate`` of [T, heads, head_dim] rows; one lookup serves a level's queries and keys."""
        while self.cos.shape[0] <= last:
            start = self.cos.shape[0]
            angles = torch.arange(start, start + self.STEP, device=self.freqs.device).float()[:, None] * self.freqs
            self.cos, self.sin = torch.cat([self.cos, angles.cos()]), torch.cat([self.sin, angles.sin()])
        return self.cos[positions][:, None], self.sin[positions][:, None]


class DraftVocabulary:
    """The target's LM head restricted to the draft vocabulary: features [rows, hidden] -> logits [rows, draft]."""

    def __init__(self, rows: torch.Tensor, draft_ids: torch.Tensor, product, embeddings: torch.Tensor):
        """``rows``: the LM head's weight rows of ``draft_ids`` [draft_vocab, hidden] (``head_modules.head_rows``);
        ``product``: ``Backend.head_product`` with the draft's precision bound; ``embeddings``: the target's input
        embeddings of ``draft_ids`` [draft_vocab, hidden] (a tree node's token is always a draft token: looked up
        here rather than through the model's embedding, which the int8 model dequantizes on each lookup)."""
        self.id_list = draft_ids.long().tolist()  # the target token id of each draft token (trees map lists)
        self.logits = product(rows)
        self.embeddings = embeddings.detach().float()


class MedusaDraft:
    """``MedusaHeads`` as two products: every head's linear at once ([K * hidden, hidden], the blocks' weights
    stacked), then the draft vocabulary over the K features."""

    def __init__(self, module: MedusaHeads, vocab: DraftVocabulary, product):
        blocks = module.blocks
        self.num_heads, self.hidden = len(blocks), int(blocks[0].linear.weight.shape[1])
        self.heads = product(torch.cat([b.linear.weight for b in blocks]), torch.cat([b.linear.bias for b in blocks]))
        self.vocab = vocab

    def fresh(self) -> "MedusaDraft":
        """This drafter itself: it holds no per-sequence state, so every sequence shares it."""
        return self

    def logits(self, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """The hidden state [hidden] that produced the root -> logits [depth, draft_vocab] of tokens root + 1 ..."""
        h = hidden.float().reshape(1, -1)
        y = self.heads(h).view(self.num_heads, self.hidden)[:depth]
        return self.vocab.logits(h + F.silu(y))


class EagleDraft:
    """An ``EagleDrafter`` (or ``Eagle3Drafter``) drafting a tree level by level over its exact cache of the
    committed positions' keys and values (last ``window``), and the keys of the tree it has drafted so far."""

    def __init__(self, module: EagleDrafter, vocab: DraftVocabulary, product, device: torch.device):
        self.home = torch.device(device)  # where the backend computes (the norms' weights live there)
        self.hidden, self.heads, self.head_dim = module.hidden, module.heads, module.head_dim
        self.window = module.window
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.fc = product(module.fc.weight, module.fc.bias)
        self.qkv = product(module.qkv.weight)
        self.out = product(module.out.weight)
        self.gate_up = product(module.gate_up.weight)
        self.down = product(module.down.weight)
        self.norm_in = (module.norm_in.weight.detach().float().to(self.home), module.norm_in.eps)
        self.norm_mlp = (module.norm_mlp.weight.detach().float().to(self.home), module.norm_mlp.eps)
        eagle3 = isinstance(module, Eagle3Drafter)
        self.fuse = product(module.fuse.weight) if eagle3 else None
        self.norm_out = ((module.norm_out.weight.detach().float().to(self.home), module.norm_out.eps) if eagle3
                         else None)
        self.vocab = vocab
        self.rope = RotaryTable(self.head_dim, self.home)
        self.reset()

    def fresh(self) -> "EagleDraft":
        """A drafter over the same products with an empty cache (one per sequence)."""
        other = copy.copy(self)
        other.rope = RotaryTable(self.head_dim, self.home)  # grows per sequence: not shared between threads
        other.reset()
        return other

    def reset(self) -> None:
        self.keys = self.values = None  # [n, heads, head_dim] of committed positions (the last window)
        self.last_x = self.last_q = None  # input [1, hidden] and query [1, heads, head_dim] of the newest one
        self.features_seen = 0  # committed positions whose target features the cache has consumed
        self.device = self.home  # where the target's hidden states are (set by ``sync``)
        self.tree_keys = self.tree_values = None  # [expanded nodes, heads, head_dim] of this step's tree

    # ----- the layer --------------------------------------------------------------------------------------------
    def _project(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, last: int):
        """``EagleDrafter.project`` over rows at ``positions`` [T] (the largest: ``last``): (x [T, hidden], q, k, v
        [T, heads, head_dim])."""
        x = self.fc(torch.cat([features, embeddings], -1))
        q, k, v = self.qkv(rms_norm(*self.norm_in, x)).split(self.hidden, -1)
        shape = (x.shape[0], self.heads, self.head_dim)
        cos, sin = self.rope.at(positions, last)
        return x, apply_rotary(q.reshape(shape), cos, sin), apply_rotary(k.reshape(shape), cos, sin), v.reshape(shape)

    def _finish(self, x, q, keys, values, mask) -> torch.Tensor:
        """``EagleDrafter.finish`` for queries [F, heads, head_dim] over shared keys/values [L, heads, head_dim],
        ``mask`` [F, L] bool (None: every key) -> the layer's outputs [F, hidden]."""
        scores = torch.matmul(q.transpose(0, 1), keys.permute(1, 2, 0)).mul_(self.scale)  # [heads, F, L]
        if mask is not None:
            scores = scores.masked_fill_(~mask, float("-inf"))
        attn = torch.matmul(scores.softmax(-1), values.transpose(0, 1))  # [heads, F, head_dim]
        x = x + self.out(attn.transpose(0, 1).reshape(x.shape[0], -1))
        gate, up = self.gate_up(rms_norm(*self.norm_mlp, x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.vocab.logits(out if self.norm_out is None else rms_norm(*self.norm_out, out))

    # ----- drafting ---------------------------------------------------------------------------------------------
    def sync(self, hidden: torch.Tensor, tokens: torch.Tensor, embed) -> None:
        """Feed the drafter the target features committed since the last step (exact: a position's keys and values
        depend only on its own input). ``hidden`` [rows, width]: the forwards' taps of the newest committed
        positions; ``tokens``: the sequence so far (its last token, the root, has none yet)."""
        committed = int(tokens.numel()) - 1  # positions with a hidden state (all but the root)
        rows, self.device = hidden.shape[0], hidden.device
        if rows >= committed or self.features_seen + rows != committed:
            self.reset()  # the prefill (or an unexpected gap): start from these rows
        start = committed - rows
        keep_from = max(start, committed - self.window)
        feats = hidden[keep_from - start:].float()
        if self.fuse is not None:
            feats = self.fuse(feats)
        x, q, key, value = self._project(feats, embed(tokens[keep_from + 1: committed + 1].to(self.device)).float(),
                                         torch.arange(keep_from, committed, device=self.device), committed - 1)
        self.keys = key if self.keys is None else torch.cat([self.keys, key])[-self.window:]
        self.values = value if self.values is None else torch.cat([self.values, value])[-self.window:]
        self.last_x, self.last_q = x[-1:], q[-1:]
        self.features_seen = committed

    def first(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth 1: (the layer's output [1, hidden] at the newest committed position, logits [1, draft_vocab])."""
        self.tree_keys = self.tree_values = None
        out = self._finish(self.last_x, self.last_q, self.keys, self.values, None)
        return out, self._logits(out)

    def level(self, parent_out: torch.Tensor, embeddings: torch.Tensor, position: int, depth: int,
              paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Expand ``F`` tree nodes at ``depth`` (their inputs: their parents' outputs [F, hidden] and their own
        tokens' embeddings [F, hidden], all at rope ``position``). ``paths[j]``: the tree columns (the order nodes
        were expanded in this step) of node j's expanded ancestors; node j's own column is the next free one.
        Each query sees the newest ``window - depth`` committed keys, its ancestors' keys and its own, as in
        training (``head_modules.unroll``). Returns (outputs [F, hidden], logits [F, draft_vocab])."""
        f = parent_out.shape[0]
        x, q, key, value = self._project(parent_out, embeddings, torch.full((f,), position, device=self.device),
                                          position)
        before = 0 if self.tree_keys is None else self.tree_keys.shape[0]
        self.tree_keys = key if self.tree_keys is None else torch.cat([self.tree_keys, key])
        self.tree_values = value if self.tree_values is None else torch.cat([self.tree_values, value])
        n_ctx = self.keys.shape[0]
        context = max(0, min(n_ctx, self.window - depth))
        keys = torch.cat([self.keys[n_ctx - context:], self.tree_keys])
        values = torch.cat([self.values[n_ctx - context:], self.tree_values])
        mask = torch.zeros(f, keys.shape[0], dtype=torch.bool)
        mask[:, :context] = True
        for j, path in enumerate(paths):
            mask[j, [context + c for c in path] + [context + before + j]] = True
        mask = mask.to(self.device)
        out = self._finish(x, q, keys, values, mask)
        return out, self._logits(out)


def draft_runner(module, vocab: DraftVocabulary, product, device: torch.device):
    """The decoding-time form of a trained heads module, its products made by ``product`` on ``device``."""
    if isinstance(module, MedusaHeads):
        return MedusaDraft(module, vocab, product)
    return EagleDraft(module, vocab, product, device)
