"""The PFS pruner (stage ``prune``): drop draft paths whose path feasibility score, the product of draft
probabilities along the path, is under a threshold, and keep at most ``max_nodes`` nodes. The threshold
adapts each step to the entropy of the draft's first-position distribution: lower when the heads are
uncertain (keep a few guesses rather than none), higher when they are confident (trim the long tail).
"""
from __future__ import annotations

import math
import struct

import torch

from mtpflow.errors import ConfigError, check_int, check_range
from mtpflow.plugins import hookimpl
from mtpflow.kernels import pfs_prune
from mtpflow.kernels.dispatch import resolve_impl
from mtpflow.kernels.pfs import path_products
from mtpflow.cost_model import CostCurve, check_costs, load_verify_costs
from mtpflow.types import DecodeState, Draft


# drafts of up to this many nodes prune over Python lists on the CPU (``PFSPruner._prune_lists``)
LIST_NODES = 256


def path_scores(draft: Draft) -> torch.Tensor:
    """[num_nodes] PFS of each node: ``draft.scores["pfs"]`` when the proposer set it, else the product of
    ``draft.probs`` along the path (1.0 everywhere for a proposer without probabilities)."""
    if "pfs" in draft.scores:
        return draft.scores["pfs"].float()
    if draft.probs is None:
        return torch.ones(draft.num_nodes)
    probs = draft.probs.float().tolist()
    out = [0.0] * len(probs)
    for i, p in enumerate(draft.parents.tolist()):
        out[i] = probs[i] * (1.0 if p < 0 else out[p])
    return torch.tensor(out)


def root_entropy(draft: Draft) -> float | None:
    """Normalized entropy (0..1) of the distribution the first draft position came from, if known."""
    ent = draft.scores.get("entropy")
    if ent is None or not draft.num_nodes:
        return None
    first = (draft.parents < 0).nonzero().flatten()
    return float(ent[first].mean()) if first.numel() else None


class PFSPruner:
    """Keep nodes with PFS >= threshold * exp(adapt * (reference_entropy - H)), clamped to
    [min_threshold, max_threshold], where H is the draft's first-position normalized entropy; then keep
    the ``max_nodes`` highest-PFS nodes. ``adapt: 0`` gives a fixed threshold.

    ``costs`` (``auto`` or {K: seconds}; null = off) adds a cost-aware budget: under a greedy gate a node is
    accepted when its whole path matches the target, so the expected accepted tokens of a tree are about the
    sum of its nodes' PFS. The pruner keeps the N highest-PFS survivors (N = 0 allowed) that maximise
    (1 + c * sum of their PFS) / cost(N), where cost is the measured verify-cost curve and c a running
    calibration (accepted tokens / predicted sum of PFS, decayed) that corrects over- or under-confident
    drafters.

    Nodes a proposer marks in ``draft.scores["calibrated"]`` carry a PFS that already is an acceptance
    estimate learned from the run (e.g. the prompt-lookup chain ``mtp`` grafts into its head tree): they skip
    the entropy threshold, are not scaled by c, and do not feed c; only the budgets apply to them.
    """

    def __init__(self, threshold: float = 0.35, adapt: float = 2.0, reference_entropy: float = 0.15,
                 min_threshold: float = 0.02, max_threshold: float = 0.9, max_nodes: int = 16,
                 costs=None, decay: float = 0.9):
        self.threshold = check_range("strategy.prune.threshold", threshold, 0, 1)
        self.adapt = check_range("strategy.prune.adapt", adapt, 0, None)
        self.reference_entropy = check_range("strategy.prune.reference_entropy", reference_entropy, 0, 1)
        self.min_threshold = check_range("strategy.prune.min_threshold", min_threshold, 0, 1)
        self.max_threshold = check_range("strategy.prune.max_threshold", max_threshold, 0, 1)
        if self.min_threshold > self.max_threshold:
            raise ConfigError("strategy.prune.min_threshold must not exceed max_threshold")
        self.max_nodes = check_int("strategy.prune.max_nodes", max_nodes, 0)
        self.last_threshold = float(threshold)  # the threshold used by the latest step, for inspection
        self.cost_mode = check_costs(costs)
        self.curve = CostCurve(self.cost_mode) if isinstance(self.cost_mode, dict) else None
        self.decay = float(check_range("strategy.prune.decay", decay, 0, 1))
        self._predicted, self._accepted = 1.0, 1.0  # calibration prior: one token predicted, one accepted
        self._last_predicted: float | None = None
        self.cost_cut_nodes = 0

    @property
    def calibration(self) -> float:
        return self._accepted / self._predicted

    @hookimpl
    def on_run_start(self, context):
        if self.cost_mode != "auto" or context.model is None:
            return None
        costs, source = load_verify_costs(context)
        self.curve = CostCurve(costs)
        return {"pfs_costs": source}

    @hookimpl
    def run_stats(self):
        if self.curve is None:
            return None
        return {"pfs_calibration": round(self.calibration, 4), "pfs_cost_cut_nodes": self.cost_cut_nodes}

    def values(self, pfs: torch.Tensor, calibrated: torch.Tensor | None) -> torch.Tensor:
        """Expected accepted tokens per node: c * PFS, or PFS itself for calibrated nodes."""
        c = self.calibration if self.curve is not None else 1.0
        scaled = pfs.double() * c
        return scaled if calibrated is None else torch.where(calibrated, pfs.double(), scaled)

    def cost_budget(self, pfs: torch.Tensor, keep: torch.Tensor, calibrated: torch.Tensor | None = None) -> torch.Tensor:
        """``keep`` narrowed to the highest-value nodes worth their verify cost (see the class docstring)."""
        idx = keep.nonzero().flatten()
        if idx.numel() == 0:
            self._last_predicted = 0.0
            return keep
        value = self.values(pfs, calibrated)
        # stable sort: ties keep node order, so a parent (PFS >= its children's) comes first
        order = idx[torch.sort(value[idx], descending=True, stable=True).indices]
        gains = torch.cumsum(value[order], 0).tolist()
        best_n = max(range(len(gains) + 1),
                     key=lambda n: ((1.0 + (gains[n - 1] if n else 0.0)) / self.curve(n), -n))
        out = torch.zeros_like(keep)
        out[order[:best_n]] = True
        self.cost_cut_nodes += int(idx.numel()) - best_n
        raw = pfs.double() if calibrated is None else torch.where(calibrated, 0.0, pfs.double())
        self._last_predicted = float(raw[out].sum())  # what c should correct: the uncalibrated nodes only
        return out

    @hookimpl
    def on_step_end(self, record) -> None:
        if self.curve is None or self._last_predicted is None:
            return
        draft = record.draft
        if draft.num_nodes:
            accepted = record.decision.accepted
            calibrated = draft.scores.get("calibrated")
            if calibrated is not None:
                accepted = accepted[calibrated[accepted] < 0.5]
            if self._last_predicted > 0 or accepted.numel():
                self._predicted = self.decay * self._predicted + self._last_predicted
                self._accepted = self.decay * self._accepted + int(accepted.numel())
        self._last_predicted = None

    def step_threshold(self, entropy: float | None) -> float:
        """The threshold for a step whose draft has first-position normalized entropy ``entropy``."""
        if entropy is None or self.adapt == 0:
            return float(self.threshold)
        t = float(self.threshold) * math.exp(self.adapt * (float(self.reference_entropy) - entropy))
        return min(max(t, float(self.min_threshold)), float(self.max_threshold))

    @hookimpl
    def prune(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        self.last_threshold = self.step_threshold(root_entropy(draft))
        if resolve_impl(None, draft.tokens.device) == "torch" and draft.num_nodes <= LIST_NODES:
            return self._prune_lists(draft)
        # threshold + budget in one pass (Triton on CUDA, torch elsewhere); ties broken by node order, so a
        # parent (never less feasible) wins over its children. Path scores the proposer set are used as given.
        if "pfs" in draft.scores or draft.probs is None:
            pfs, keep = pfs_prune(path_scores(draft), torch.full((draft.num_nodes,), -1), self.last_threshold,
                                  self.max_nodes)
        else:
            pfs, keep = pfs_prune(draft.probs, draft.parents, self.last_threshold, self.max_nodes)
        pfs, keep = pfs.cpu(), keep.cpu()
        calibrated = draft.scores.get("calibrated")
        if calibrated is not None:
            calibrated = calibrated.cpu() > 0.5
            keep = keep | calibrated  # no threshold for them; the node budget again over the union
            if int(keep.sum()) > self.max_nodes:
                idx = keep.nonzero().flatten()
                value = self.values(pfs, calibrated)
                top = idx[torch.sort(value[idx], descending=True, stable=True).indices[: self.max_nodes]]
                keep = torch.zeros_like(keep)
                keep[top] = True
        if self.curve is not None:
            keep = self.cost_budget(pfs, keep, calibrated)
        return keep

    def _prune_lists(self, draft: Draft) -> torch.Tensor:
        """``prune``'s rule over Python lists: the same floats (float32 PFS, the threshold rounded to float32, the
        values and their running sums in double, stable sorts) as the tensor path, whose two dozen small torch ops
        cost more than the rule itself on a draft of a few dozen nodes."""
        n = draft.num_nodes
        if "pfs" in draft.scores or draft.probs is None:
            pfs = path_scores(draft).tolist()
        else:
            pfs = path_products(draft.probs, draft.parents).tolist()
        threshold = _float32(self.last_threshold)
        order = sorted(range(n), key=lambda i: -pfs[i])[: self.max_nodes]  # stable: ties to the lower index
        best = set(order)
        keep = [pfs[i] >= threshold and i in best for i in range(n)]
        marks = draft.scores.get("calibrated")
        calibrated = None if marks is None else [m > 0.5 for m in marks.tolist()]
        c = self.calibration if self.curve is not None else 1.0
        value = [p if calibrated is not None and calibrated[i] else p * c for i, p in enumerate(pfs)]
        if calibrated is not None:
            keep = [a or b for a, b in zip(keep, calibrated)]
            if sum(keep) > self.max_nodes:
                top = set(sorted((i for i in range(n) if keep[i]), key=lambda i: -value[i])[: self.max_nodes])
                keep = [i in top for i in range(n)]
        if self.curve is not None:
            idx = [i for i in range(n) if keep[i]]
            if not idx:
                self._last_predicted = 0.0
            else:
                ranked = sorted(idx, key=lambda i: -value[i])
                gains, total = [], 0.0
                for i in ranked:
                    total += value[i]
                    gains.append(total)
                best_n = max(range(len(gains) + 1),
                             key=lambda m: ((1.0 + (gains[m - 1] if m else 0.0)) / self.curve(m), -m))
                chosen = set(ranked[:best_n])
                keep = [i in chosen for i in range(n)]
                self.cost_cut_nodes += len(idx) - best_n
                predicted = 0.0  # what c should correct: the uncalibrated nodes only
                for i in range(n):
                    if keep[i] and not (calibrated is not None and calibrated[i]):
                        predicted += pfs[i]
                self._last_predicted = predicted
        return torch.tensor(keep, dtype=torch.bool)


def _float32(x: float) -> float:
    """``x`` rounded to float32 (what comparing a float32 tensor with it does)."""
    return struct.unpack("f", struct.pack("f", x))[0]
