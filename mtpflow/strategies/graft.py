"""Grafting one drafter's tree into another's draft: the union of both trees from the root, nodes with the
same token under the same parent shared. The host draft's nodes keep their indices (new nodes are appended, so
a host proposer that reads ``record.decision.accepted`` still finds its own nodes) and every score it carries
is extended to the new nodes. ``mtp`` grafts prompt lookup, token recycling and the suffix cache this way.
"""
from __future__ import annotations

import torch

from mtpflow.types import Draft


def graft_tree(draft: Draft, tokens: list[int], parents: list[int], pfs: list[float], mark: str,
               extra: dict[str, list[float]] | None = None, calibrated: bool = True) -> Draft:
    """``draft`` with the tree (``tokens``, ``parents`` in topological order, -1 = child of the root) merged in
    (``GraftedTree.add`` says how); several trees at once: ``GraftedTree``."""
    if not tokens:
        return draft
    merged = GraftedTree.of_draft(draft)
    merged.add(tokens, parents, pfs, mark, extra, calibrated)
    return merged.draft()


class GraftedTree:
    """A host draft as Python lists while trees are grafted into it one after another (``add``), a ``Draft`` again
    at the end (``draft``): one conversion each way however many trees are grafted (a conversion of a small draft
    costs more than the merge itself). The result is the one ``graft_tree`` gives applied tree by tree."""

    def __init__(self, tokens: list[int], parents: list[int], probs: list[float], scores: dict[str, list[float]],
                 source: str, host: Draft | None = None):
        """A host tree as lists (a drafter's own nodes): ``probs`` each node's draft probability, ``scores`` per-node
        scores, "pfs" among them; ``host``: the ``Draft`` they came from (``of_draft``), given back when nothing is
        grafted, its ``dists`` extended otherwise."""
        self.host, self.n, self.source, self.grafted = host, len(tokens), source, False
        self.tokens, self.parents, self.probs = list(tokens), list(parents), list(probs)
        self.scores = {key: list(value) for key, value in scores.items()}
        self.child = {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens))}
        self.first_child: dict[int, int] = {}  # parent -> its lowest-numbered child
        for i, p in enumerate(self.parents):
            self.first_child.setdefault(p, i)

    @classmethod
    def of_draft(cls, draft: Draft) -> GraftedTree:
        """``draft`` as the host (its path scores from its probabilities where it has no "pfs")."""
        parents = draft.parents.tolist()
        probs = draft.probs.tolist() if draft.probs is not None else [1.0] * len(parents)
        scores = {key: value.tolist() for key, value in draft.scores.items()}
        if "pfs" not in scores:
            scores["pfs"] = _path_products(probs, parents) if draft.probs is not None else [1.0] * len(parents)
        return cls(draft.tokens.tolist(), parents, probs, scores, draft.source, draft)

    def add(self, tokens: list[int], parents: list[int], pfs: list[float], mark: str,
            extra: dict[str, list[float]] | None = None, calibrated: bool = True) -> None:
        """Merge the tree (``tokens``, ``parents`` in topological order, -1 = child of the root) in from the root.

        ``pfs`` is each grafted node's path feasibility (an estimate of its chance to be accepted); a shared node
        keeps the larger of its two scores. ``scores[mark]`` is 1.0 on every node of the grafted tree (shared or
        new), ``scores["grafted"]`` on the nodes it added; with ``calibrated`` the grafted nodes also go to
        ``scores["calibrated"]`` (their PFS is an acceptance estimate learned from the run, which the PFS pruner
        takes as it is). ``extra`` gives more per-node scores of the grafted tree (0.0 elsewhere; a shared node
        takes the grafted value). A new node's entropy is its first sibling's, else its parent's, every other
        score of the host 0.0. A stochastic host draft (``dists`` set) gets one-hot
        rows for new nodes: a deterministic token is a draft from a point mass, which the speculative-sampling
        gate handles exactly. An empty tree changes nothing."""
        if not tokens:
            return
        if not self.tokens:
            self.source = mark
        self.grafted = True
        scores = self.scores
        size = len(self.tokens)
        for key in (mark, "grafted", "calibrated", *(extra or {})):
            scores.setdefault(key, [0.0] * size)
        entropy = scores.get("entropy")
        zeros = [value for key, value in scores.items() if key != "entropy"]
        where: list[int] = []  # grafted node -> node in the merged draft
        for j, (token, parent) in enumerate(zip(tokens, parents)):
            token = int(token)
            host_parent = -1 if parent < 0 else where[parent]
            node = self.child.get((host_parent, token))
            if node is None:
                node = len(self.tokens)
                if entropy is not None:
                    sibling = self.first_child.get(host_parent)
                    entropy.append(entropy[sibling] if sibling is not None
                                   else (entropy[host_parent] if host_parent >= 0 else 0.0))
                self.first_child.setdefault(host_parent, node)
                self.tokens.append(token)
                self.parents.append(host_parent)
                own = float(pfs[j]) / (1.0 if parent < 0 else max(float(pfs[parent]), 1e-12))
                self.probs.append(min(own, 1.0))
                for value in zeros:
                    value.append(0.0)
                scores["pfs"][node] = float(pfs[j])
                scores["grafted"][node] = 1.0
                self.child[(host_parent, token)] = node
            else:
                scores["pfs"][node] = max(scores["pfs"][node], float(pfs[j]))
            scores[mark][node] = 1.0
            if calibrated:
                scores["calibrated"][node] = 1.0
            for key, value in (extra or {}).items():
                scores[key][node] = float(value[j])
            where.append(node)

    def add_chain(self, chain: list[int], acceptance: float, mark: str) -> None:
        """Merge a deterministic chain (e.g. a prompt-lookup match) in from the root, as ``add`` merges a tree: chain
        tokens the tree already has are shared, the rest become new nodes; node d of the chain scores
        ``acceptance ** d`` as its path feasibility (``acceptance`` is learned from the run: calibrated), so a shared
        node keeps the larger of its two scores and a parent never scores below its children."""
        pfs, score = [], 1.0
        for _ in chain:
            score *= acceptance
            pfs.append(score)
        self.add([int(t) for t in chain], list(range(-1, len(chain) - 1)), pfs, mark)

    def draft(self) -> Draft:
        """The merged tree as a ``Draft`` (the host ``Draft`` itself when nothing was grafted into it)."""
        if not self.grafted and self.host is not None:
            return self.host
        n, size = self.n, len(self.tokens)
        dists = None if self.host is None else self.host.dists
        if dists is not None and size > n:
            # on the host draft's distributions' device (a drafter may keep them where its logits are)
            onehot = torch.zeros(size - n, dists.shape[-1], dtype=dists.dtype, device=dists.device)
            onehot[torch.arange(size - n, device=dists.device),
                   torch.tensor(self.tokens[n:], device=dists.device)] = 1.0
            dists = torch.cat([dists, onehot])
        return Draft(torch.tensor(self.tokens, dtype=torch.long), torch.tensor(self.parents, dtype=torch.long),
                     probs=torch.tensor(self.probs, dtype=torch.float32), dists=dists, source=self.source,
                     scores={key: torch.tensor(value, dtype=torch.float32) for key, value in self.scores.items()})


def calibrated_tree(tokens: list[int], parents: list[int], probs: list[float], pfs: list[float], source: str,
                    mark: str, mark_values: list[float] | None = None) -> Draft:
    """A drafter's own tree as a ``Draft`` whose PFS is an acceptance estimate learned from the run: every node
    marked ``calibrated`` (the PFS pruner takes it as it is) and ``scores[mark]`` (1.0, or ``mark_values``) so the
    drafter finds its nodes again when it learns from the step. Empty input gives an empty draft."""
    if not tokens:
        return Draft.empty(source)
    n = len(tokens)
    marks = torch.ones(n) if mark_values is None else torch.tensor(mark_values, dtype=torch.float32)
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                 probs=torch.tensor(probs, dtype=torch.float32), source=source,
                 scores={"pfs": torch.tensor(pfs, dtype=torch.float32), "calibrated": torch.ones(n), mark: marks})


def _path_products(probs: list[float], parents: list[int]) -> list[float]:
    out = [0.0] * len(probs)
    for i, p in enumerate(parents):
        out[i] = probs[i] * (1.0 if p < 0 else out[p])
    return out
