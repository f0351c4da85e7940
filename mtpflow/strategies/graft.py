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
    """``draft`` with the tree (``tokens``, ``parents`` in topological order, -1 = child of the root) merged in.

    ``pfs`` is each grafted node's path feasibility (an estimate of its chance to be accepted); a shared node
    keeps the larger of its two scores. ``scores[mark]`` is 1.0 on every node of the grafted tree (shared or
    new), ``scores["grafted"]`` on the nodes it added; with ``calibrated`` the grafted nodes also go to
    ``scores["calibrated"]`` (their PFS is an acceptance estimate learned from the run, which the PFS pruner
    takes as it is). ``extra`` gives more per-node scores of the grafted tree (0.0 elsewhere; a shared node
    takes the grafted value). A stochastic host draft (``dists`` set) gets one-hot rows for new nodes: a
    deterministic token is a draft from a point mass, which the speculative-sampling gate handles exactly.
    """
    n = draft.num_nodes
    if not tokens:
        return draft
    out_tokens, out_parents = draft.tokens.tolist(), draft.parents.tolist()
    probs = draft.probs.tolist() if draft.probs is not None else [1.0] * n
    scores = {key: value.tolist() for key, value in draft.scores.items()}
    if "pfs" not in scores:
        scores["pfs"] = _path_products(probs, out_parents) if draft.probs is not None else [1.0] * n
    for key in (mark, "grafted", "calibrated", *(extra or {})):
        scores.setdefault(key, [0.0] * n)
    child = {(p, t): i for i, (p, t) in enumerate(zip(out_parents, out_tokens))}
    where: list[int] = []  # grafted node -> node in the merged draft
    for j, (token, parent) in enumerate(zip(tokens, parents)):
        host_parent = -1 if parent < 0 else where[parent]
        node = child.get((host_parent, int(token)))
        if node is None:
            node = len(out_tokens)
            out_tokens.append(int(token))
            out_parents.append(host_parent)
            own = float(pfs[j]) / (1.0 if parent < 0 else max(float(pfs[parent]), 1e-12))
            probs.append(min(own, 1.0))
            for key, value in scores.items():
                value.append(_new_node_score(key, value, host_parent, out_parents))
            scores["pfs"][node] = float(pfs[j])
            scores["grafted"][node] = 1.0
            child[(host_parent, int(token))] = node
        else:
            scores["pfs"][node] = max(scores["pfs"][node], float(pfs[j]))
        scores[mark][node] = 1.0
        if calibrated:
            scores["calibrated"][node] = 1.0
        for key, value in (extra or {}).items():
            scores[key][node] = float(value[j])
        where.append(node)
    dists = draft.dists
    if dists is not None and len(out_tokens) > n:
        # on the host draft's distributions' device (a drafter may keep them where its logits are)
        onehot = torch.zeros(len(out_tokens) - n, dists.shape[-1], dtype=dists.dtype, device=dists.device)
        onehot[torch.arange(len(out_tokens) - n, device=dists.device),
               torch.tensor(out_tokens[n:], device=dists.device)] = 1.0
        dists = torch.cat([dists, onehot])
    return Draft(torch.tensor(out_tokens, dtype=torch.long), torch.tensor(out_parents, dtype=torch.long),
                 probs=torch.tensor(probs, dtype=torch.float32), dists=dists, source=draft.source if n else mark,
                 scores={key: torch.tensor(value, dtype=torch.float32) for key, value in scores.items()})


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


def _new_node_score(key: str, value: list[float], parent: int, parents: list[int]) -> float:
    """A host score for a grafted node: the entropy of the distribution its siblings (else its parent) came
    from, as ``graft_chain`` does; 0.0 for marks and anything else."""
    if key != "entropy":
        return 0.0
    sibling = next((i for i, p in enumerate(parents[:-1]) if p == parent), None)
    if sibling is not None:
        return value[sibling]
    return value[parent] if parent >= 0 else 0.0
