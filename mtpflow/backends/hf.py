"""The ``hf`` backend: the target's forwards in PyTorch over the model's own modules, on any device.

Llama-family models on SDPA take the lean forward (``mtpflow.forward``: HF's arithmetic without its per-call
glue); every other causal LM takes ``model(...)`` with the KV pool's ``Cache`` views. This is the reference every
other backend is tested against, and the backend wherever no faster one applies (``mtpflow.backends.create``).
"""
from __future__ import annotations

import time

import torch

from mtpflow import forward as lean_forward
from mtpflow.backends.base import Backend, tree_allowed  # noqa: F401 (re-exported: cuda_graph, the tests)
from mtpflow.kv_cache import BatchCache
from mtpflow.types import Verification

# prompt rows per packed prefill forward: bounds its activations; a longer prompt is prefilled alone
PACKED_PREFILL_ROWS = 2048


def sliding(model) -> tuple[str, int] | None:
    """How the model's own forward slides its attention, for the 4D masks this backend builds (HF returns a 4D mask
    as it is given, so a tree or a batch would see past a sliding window): ``("layer_types", w)`` where layers
    marked ``sliding_attention`` see the last ``w`` positions and the forward takes a mask per layer type,
    ``("all", w)`` where every layer does, None where no layer slides (or the family is not one the native layer
    description knows: its masks are left as they were)."""
    from mtpflow.backends.native.description import FAMILIES

    family = FAMILIES.get(type(model).__name__)
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    if family is None or family.window == "none" or not window:
        return None
    if family.window == "layer_types" and "sliding_attention" not in (getattr(cfg, "layer_types", None) or ()):
        return None
    return family.window, int(window)


def attention_masks(model, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                    dtype) -> torch.Tensor | dict:
    """The additive mask [B, 1, q, kv] (0 where ``allowed`` [B, q, kv], the dtype's minimum elsewhere) a forward
    takes, or for a model whose layers slide (``sliding``) what its sliding layers need as well: a query at
    position p sees a key at position k only where p - k < w. ``query_positions`` [B, q], ``key_positions`` [B, kv]:
    each row's and each entry's position (the pool keeps entry i of a sequence at position i)."""
    def additive(visible):
        return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)[:, None]

    slide = sliding(model)
    if slide is None:
        return additive(allowed)
    kind, window = slide
    near = allowed & (query_positions[:, :, None] - key_positions[:, None, :] < window)
    if kind == "all":
        return additive(near)
    return {"full_attention": additive(allowed), "sliding_attention": additive(near)}


def _to(mask, device):
    return {k: v.to(device) for k, v in mask.items()} if isinstance(mask, dict) else mask.to(device)


def own_taps(hidden: torch.Tensor, taps: tuple[int, ...], own: tuple[int, ...]) -> torch.Tensor:
    """[n, hidden * len(taps)] of the batch's taps -> [n, hidden * len(own)], this sequence's in its order."""
    if own == taps:
        return hidden
    size = hidden.shape[-1] // len(taps)
    return torch.cat([hidden[:, taps.index(t) * size : (taps.index(t) + 1) * size] for t in own], dim=-1)


class HFBackend(Backend):
    """Forwards in PyTorch: the lean forward for Llama-family models, ``model(...)`` for the rest."""

    name = "hf"

    def __init__(self, model, lean: bool = True):
        """``lean``: Llama-family models take the lean forward (``mtpflow.forward``; ``model.lean_forward``)."""
        super().__init__(model)
        self.lean = lean
        # the linear products of the lean forward: the model's own modules (the native backend passes its own)
        self.products = lean_forward.MODULE_PRODUCTS

    def _run(self, input_ids, positions, mask, cache, taps, logits_to_keep: int = 0):
        return lean_forward.run(self.model, input_ids, positions, mask, cache, taps, logits_to_keep,
                                products=self.products, lean=self.lean)

    # ----- prefill ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, targets, prompts, prefix_cache=None, starts=None):
        starts = starts or [0] * len(targets)
        outputs: list = [None] * len(targets)
        packable = len(targets) > 1 and self.lean and lean_forward.supports(self.model)
        group: list[int] = []

        def run_group():
            if len(group) == 1 or (group and not packable):
                for i in group:
                    outputs[i] = self._prefill_one(targets[i], prompts[i], starts[i])
            elif group:
                for i, out in zip(group, self._prefill_packed([targets[i] for i in group],
                                                              [prompts[i] for i in group],
                                                              [starts[i] for i in group])):
                    outputs[i] = out
            group.clear()

        rows = 0
        for i, prompt in enumerate(prompts):
            n = int(prompt.numel())
            if group and (not packable or rows + n > PACKED_PREFILL_ROWS):
                run_group()
                rows = 0
            group.append(i)
            rows += n
        run_group()
        return outputs

    def _prefill_one(self, target, tokens: torch.Tensor, start: int):
        cache = target.kv.view()
        ids = tokens.to(self.device)[None]
        positions = torch.arange(start, start + tokens.numel(), device=self.device)[None] - target.position_shift
        logits, hidden = self._run(ids, positions, None, cache, target.taps, logits_to_keep=1)
        target.kv.length = cache.layers[0].length
        target.forwards += 1
        return logits[0, -1:].float(), (hidden[0].float() if hidden is not None else None)

    def _prefill_packed(self, targets, tokens, starts):
        """One packed forward over several targets' prompt rows: (logits [1, vocab], taps [n, ...] or None) each."""
        taps = tuple(sorted({t for target in targets for t in target.taps}))
        caches = [target.kv.view() for target in targets]
        positions = [torch.arange(start, start + int(t.numel()), device=self.device) for start, t in zip(starts, tokens)]
        logits, hidden = lean_forward.forward_packed(self.model, [t.to(self.device) for t in tokens], positions,
                                                     caches, taps, products=self.products)
        out = []
        for i, (target, cache) in enumerate(zip(targets, caches)):
            target.kv.length = cache.layers[0].length
            target.forwards += 1
            own = own_taps(hidden[i], taps, target.taps).float() if hidden is not None and target.taps else None
            out.append((logits[i:i + 1].float(), own))
        return out

    # ----- verify -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, targets, roots, drafts, root_positions):
        t0 = time.perf_counter()
        if len(targets) == 1:
            return [self._verify_one(targets[0], roots[0], drafts[0], root_positions[0], t0)]
        return self._verify_padded(targets, roots, drafts, root_positions, t0)

    def _verify_one(self, target, root: int, draft, root_position: int, t0: float) -> Verification:
        """One sequence alone, no padding; chains use the causal mask."""
        ids = torch.cat([torch.tensor([root], dtype=torch.long), draft.tokens])
        if draft.num_nodes == 0 or draft.is_chain:
            positions = torch.arange(root_position, root_position + ids.numel())
            mask = None
        else:
            positions = torch.cat([torch.tensor([root_position]), root_position + draft.depths()])
            length = target.cache_len
            allowed = torch.zeros(ids.numel(), length + ids.numel(), dtype=torch.bool)
            allowed[:, :length] = True
            allowed[:, length:] = tree_allowed(draft.parents)
            keys = torch.cat([torch.arange(length), positions - target.position_shift])
            mask = _to(attention_masks(self.model, allowed[None], (positions - target.position_shift)[None],
                                       keys[None], self.dtype), self.device)
        cache = target.kv.view()
        logits, hidden = self._run(ids.to(self.device)[None], (positions - target.position_shift).to(self.device)[None],
                                   mask, cache, target.taps)
        target.kv.length = cache.layers[0].length
        target.forwards += 1
        return Verification(logits=logits[0].float(), hidden=hidden[0].float() if hidden is not None else None,
                            forward_seconds=time.perf_counter() - t0)

    def _verify_padded(self, targets, roots, drafts, root_positions, t0: float) -> list[Verification]:
        """ONE forward over every sequence in the pool: each row feeds its root plus its own draft (chain or
        tree, any size, none at all) over its own cache length.

        Layout: rows padded to the longest ``1 + num_nodes`` (the model takes ``[B, q]`` input ids); a 4D mask
        ``[B, 1, q, max_len + q]`` gives each row its prefix, its own tree and nothing of its padding, and
        ``position_ids [B, q]`` count from each sequence's first token. Pool slots that are not in ``targets``
        (a sequence still waiting for its prefill, or verifying alone) ride along as fully padded rows. The
        forward returns the union of the targets' hidden-state taps; each sequence gets its own taps back."""
        pool = targets[0].pool
        rows = pool.used
        by_slot = {t.kv.slot: i for i, t in enumerate(targets)}
        sizes = [1 + d.num_nodes for d in drafts]
        q = max(sizes)
        lengths = [owner.length for owner in pool.owners]
        cache = BatchCache(pool, lengths, q)
        allowed = torch.zeros(rows, q, cache.kv_length, dtype=torch.bool)
        input_ids = torch.zeros(rows, q, dtype=torch.long)
        positions = torch.zeros(rows, q, dtype=torch.long)
        pad = torch.arange(q)
        key_positions = torch.zeros(rows, cache.kv_length, dtype=torch.long)
        key_positions[:] = torch.arange(cache.kv_length)
        for slot in range(rows):
            length = lengths[slot]
            allowed[slot, pad, length + pad] = True  # a padding row sees itself only (no empty softmax)
            i = by_slot.get(slot)
            if i is None:
                continue
            target, draft, n = targets[i], drafts[i], sizes[i]
            allowed[slot, :n, :length] = True
            allowed[slot, :n, length : length + n] = tree_allowed(draft.parents)
            input_ids[slot, 0] = roots[i]
            input_ids[slot, 1:n] = draft.tokens
            base = root_positions[i] - target.position_shift
            positions[slot] = base
            positions[slot, 1:n] = base + draft.depths()
            key_positions[slot, length:length + n] = positions[slot, :n]
        mask = attention_masks(self.model, allowed, positions, key_positions, self.dtype)
        taps = tuple(sorted({t for target in targets for t in target.taps}))
        logits, hidden = self._run(input_ids.to(self.device), positions.to(self.device), _to(mask, self.device), cache,
                                   taps)
        seconds = time.perf_counter() - t0
        logits = logits.float()
        hidden = hidden.float() if hidden is not None else None
        results = []
        for target, n in zip(targets, sizes):
            slot = target.kv.slot
            target.kv.length += n
            target.forwards += 1
            h = own_taps(hidden[slot, :n], taps, target.taps) if hidden is not None and target.taps else None
            results.append(Verification(logits=logits[slot, :n], hidden=h, forward_seconds=seconds))
        return results


def reference(model, spec=None) -> Backend:
    """The ``hf`` backend over ``model``: the reference every other backend is tested against, and what a forward
    outside an engine (a bare ``Target``, a cost measurement without an engine) runs. ``spec``: an
    ``ExecutionSpec`` whose ``lean_forward`` it follows."""
    return HFBackend(model, lean=spec.lean_forward if spec is not None else True)
