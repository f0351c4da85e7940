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
    # over lists: three torch operations on a few dozen nodes cost more than the mean itself
    first = [e for e, p in zip(ent.tolist(), draft.parents.tolist()) if p < 0]
    return sum(first) / len(first) if first else None


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
        # threshold + budget: ties broken by node order, so a parent (never less feasible) wins over its children;
        # path scores the proposer set are used as given. On the CPU over Python lists (a draft is a few dozen
        # nodes: two dozen small torch ops cost more than the rule), else the kernel (Triton on CUDA)
        if resolve_impl(None, draft.tokens.device) == "torch":
            pfs = (path_scores(draft) if "pfs" in draft.scores or draft.probs is None
                   else path_products(draft.probs, draft.parents)).tolist()
            keep = threshold_and_budget(pfs, self.last_threshold, self.max_nodes)
        else:
            if "pfs" in draft.scores or draft.probs is None:
                pfs_t, keep_t = pfs_prune(path_scores(draft), torch.full((draft.num_nodes,), -1), self.last_threshold,
                                          self.max_nodes)
            else:
                pfs_t, keep_t = pfs_prune(draft.probs, draft.parents, self.last_threshold, self.max_nodes)
            pfs, keep = pfs_t.cpu().tolist(), keep_t.cpu().tolist()
        n = len(pfs)
        marks = draft.scores.get("calibrated")
        calibrated = [False] * n if marks is None else [m > 0.5 for m in marks.cpu().tolist()]
        # expected accepted tokens per node: c * PFS, or PFS itself for calibrated nodes (in double)
        c = self.calibration if self.curve is not None else 1.0
        value = [p if calibrated[i] else p * c for i, p in enumerate(pfs)]
        if marks is not None:
            keep = [a or b for a, b in zip(keep, calibrated)]  # no threshold for them; the node budget again
            if sum(keep) > self.max_nodes:
                top = set(best_first((i for i in range(n) if keep[i]), value)[: self.max_nodes])
                keep = [i in top for i in range(n)]
        if self.curve is not None:
            keep = self._cost_budget(keep, pfs, value, calibrated)
        return torch.tensor(keep, dtype=torch.bool)

    def _cost_budget(self, keep: list[bool], pfs: list[float], value: list[float],
                     calibrated: list[bool]) -> list[bool]:
        """``keep`` narrowed to the highest-value nodes worth their verify cost (see the class docstring)."""
        ranked = best_first((i for i, k in enumerate(keep) if k), value)
        if not ranked:
            self._last_predicted = 0.0
            return keep
        gains, total = [], 0.0
        for i in ranked:
            total += value[i]
            gains.append(total)
        best_n = max(range(len(gains) + 1), key=lambda m: ((1.0 + (gains[m - 1] if m else 0.0)) / self.curve(m), -m))
        chosen = set(ranked[:best_n])
        self.cost_cut_nodes += len(ranked) - best_n
        # what c should correct: the uncalibrated nodes only
        self._last_predicted = sum(pfs[i] for i in sorted(chosen) if not calibrated[i])
        return [i in chosen for i in range(len(keep))]


def best_first(nodes, value: list[float]) -> list[int]:
    """``nodes`` by decreasing value, ties in node order (a stable sort: a parent, never worth less, comes first)."""
    return sorted(nodes, key=lambda i: -value[i])


def threshold_and_budget(pfs: list[float], threshold: float, budget: int) -> list[bool]:
    """``kernels.pfs.keep_by_threshold_and_budget`` over a list: PFS >= the threshold (rounded to float32, as the
    comparison with a float32 tensor does) and among the ``budget`` best (PFS descending, index ascending)."""
    best = set(best_first(range(len(pfs)), pfs)[:budget])
    threshold = _float32(threshold)
    return [p >= threshold and i in best for i, p in enumerate(pfs)]


def _float32(x: float) -> float:
    """``x`` rounded to float32 (what comparing a float32 tensor with it does)."""
    return struct.unpack("f", struct.pack("f", x))[0]
