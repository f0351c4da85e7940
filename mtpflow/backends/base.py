"""The one interface between the decode loop and the target model's forwards.

The loop decides *what* to verify; a backend decides *how* the target computes it. The engine picks one backend
per engine (``mtpflow.backends.create``) and owns the KV pool; every target forward goes through these calls:

- ``prefill(targets, prompts, prefix_cache)``: new sequences' prompts into their KV slots (packed where the
  backend can), with the hidden-state taps their strategies need;
- ``verify(targets, roots, drafts, root_positions)``: each sequence's root plus its chain or tree over its slot,
  in ONE forward: logits rows (for a sequence that reads only the argmax, a backend may return logits whose
  argmax is exact and the rest bounded: ``Verification.logits``);
- ``self_draft(target, root, position, steps, layers)``: greedy tokens from a cheaper copy of the target itself
  (or its first ``layers`` layers), or None where the backend has none;
- ``describe()``: what computes the forwards, the key of every cost measurement;
- ``head_product(weight, bias, int8)``: a draft head's linear as a callable over the backend's own copy of the weight
  (the native backends: their row and panel kernels, or the int8 model's W8A8 product);
- ``fall_back(reason, ...)``: a forward the backend's fast path declines runs a slower one under a name, counted
  in ``stats()`` and marked on each ``Verification`` (the run's stats count them: ``backend_fallbacks``).

A ``Target`` (``mtpflow.target``) is one sequence's slot in the pool; the backend reads and advances its length.
A backend never changes the user's model: copies it needs (fused, packed, int8) are its own.
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import replace

import torch
import torch.nn.functional as F

from mtpflow.kv_cache import KVPool


class Backend:
    """What every backend provides; ``mtpflow.backends.hf.HFBackend`` is the reference implementation."""

    name = "base"

    def __init__(self, model):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.spec = None  # the ExecutionSpec it was built from (``mtpflow.backends.create`` sets it)
        self.fallbacks: collections.Counter[str] = collections.Counter()  # declined forwards, by reason

    def fall_back(self, reason: str, results: list | None = None) -> list | None:
        """Count one forward this backend's fast path declined (``reason``: what made it decline) and mark each
        ``Verification`` of ``results`` (the fallback's) with it."""
        self.fallbacks[reason] += 1
        return None if results is None else [replace(v, fallback=reason) for v in results]

    def prefill(self, targets: list, prompts: list[torch.Tensor], prefix_cache=None,
                starts: list[int] | None = None) -> list[tuple]:
        """Prefill new sequences: ``(logits [1, vocab] of the last row, hidden taps [len, ...] or None)`` each;
        ``starts[i]``: the position of ``prompts[i]``'s first token (entries before it are in the slot already)."""
        raise NotImplementedError

    def verify(self, targets: list, roots: list[int], drafts: list, root_positions: list[int]) -> list:
        """ONE forward over every target's root and draft: a ``Verification`` per target."""
        raise NotImplementedError

    def self_draft(self, target, root: int, position: int, steps: int, layers: int | None = None) -> list[int] | None:
        """``steps`` greedy tokens after ``root`` (at rope ``position``) from a cheaper copy of the target over
        the target's own slot, or None where this backend has no self-draft. ``layers``: from the target's first
        ``layers`` layers only (where ``drafts_layers``)."""
        return None

    # whether ``self_draft`` takes ``layers``: a backend whose model's own modules cannot run its first layers (the
    # int8 model) drafts with them itself
    drafts_layers: bool = False

    # entries a sequence's cache may hold, where the backend bounds it below the model's context (None: no bound)
    context_limit: int | None = None

    def make_pool(self, max_slots: int):
        """The engine's KV pool: grows with the longest sequence by default."""
        return KVPool(self.model, max_slots)

    def takes_argmax_only(self) -> bool:
        """Whether verifies of sequences that read only each row's argmax run a cheaper exact-argmax head."""
        return False

    def kernel_identity(self) -> str:
        """What computes beyond the backend, device and dtype (a native kernel's build), or ""."""
        return ""

    def describe(self) -> str:
        """What computes the forwards (backend, device, dtype, kernel version): the key of cost measurements."""
        parts = [self.name, str(self.device), str(self.dtype).replace("torch.", ""), self.kernel_identity()]
        return " ".join(p for p in parts if p)

    @contextlib.contextmanager
    def running(self):
        """Held by the thread that decodes, around all its forwards."""
        yield

    def thread_idle(self) -> None:
        """The calling thread is about to wait or go idle (a backend may release what the thread holds)."""

    def stats(self) -> dict:
        """Figures for a run's stats (memory the backend holds, the forwards it declined, ...)."""
        out = {"backend": self.name}
        if self.fallbacks:
            out["backend_fallbacks"] = dict(self.fallbacks)
        return out

    def head_product(self, weight: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = False):
        """A draft head's linear ``x [..., in] -> x @ weight.T + bias [..., out]`` as a callable over this backend's
        own copy of ``weight`` [out, in] (``bias`` [out] or None), for the few rows of a drafting step. ``int8``: an
        int8 copy where the backend has an int8 product (the native backends); a draft's precision changes what it
        proposes, never what the target emits. This default: float32, torch."""
        w = weight.detach().to(self.device, torch.float32).contiguous()
        b = None if bias is None else bias.detach().to(self.device, torch.float32).contiguous()
        return lambda x: F.linear(x.float(), w, b)


def tree_allowed(parents: torch.Tensor) -> torch.Tensor:
    """[1 + num_nodes, 1 + num_nodes] bool: row i may attend to column j (the root, itself, its ancestors)."""
    n = int(parents.numel())
    rows = [[True] + [False] * n]  # every node sees the root; over lists, one tensor at the end (once a step)
    for i, p in enumerate(parents.tolist()):
        row = list(rows[p + 1]) if p >= 0 else [True] + [False] * n
        row[i + 1] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)

