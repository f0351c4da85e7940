"""Token recycling (Luo et al., "Turning Trash into Treasure", ACL 2025): a training-free drafter that keeps the
target's top-k candidates from every verify forward in an adjacency table (token -> the k tokens the target
ranked highest after it, most recent forward wins), expands a draft tree from the root by breadth-first search
over a fixed tree template, and updates the table after each step, rejected branches included.

The table is ``vocab x top_k`` int32 (1.5 MB for SmolLM2's 49152 tokens at k = 8), fixed in size, so it is
bounded by construction. It lives on the CPU whatever the model's device, like the drafts it builds: expanding a
tree reads a few entries per level, which on a GPU would be a host sync each; each step copies the verify
forward's top-k ids (``[1 + num_nodes, top_k]``) over once. It can be shared across requests (``shared: true``,
the default: measured ahead, see docs/drafters.md) through ``RunContext.shared``, under a lock. Each template
node learns how often it is accepted when its parent was, so a node's PFS is an acceptance estimate and the
cost-aware PFS pruner keeps the part of the template that pays for its verify cost.
"""
from __future__ import annotations

import heapq
import sys
import threading
from typing import Any

import numpy as np
import torch

from mtpflow.errors import ConfigError, check_int, check_k, check_range
from mtpflow.plugins import hookimpl
from mtpflow.strategies.graft import calibrated_tree
from mtpflow.types import DecodeState, Draft, StepRecord

SOURCE = "token_recycling"
MARK = "recycling_node"  # draft score: template index + 1 of a recycled node, 0 elsewhere
# Prior acceptance of the rank-r candidate given its parent was accepted (rank 0 = the target's argmax after
# that token in some earlier context); the template is cut from these and each node then learns its own.
RANK_PRIOR = (0.45, 0.15, 0.08, 0.05, 0.035, 0.025, 0.02, 0.015)


class TreeTemplate:
    """The static tree the draft is expanded along: node i is the ``ranks[i]``-th candidate of its parent's
    token (``parents[i]``, -1 = the root), nodes in breadth-first order. Cut best-first from ``RANK_PRIOR``:
    the ``max_nodes`` nodes with the largest product of priors along their path, at most ``max_depth`` deep."""

    def __init__(self, max_nodes: int, max_depth: int, top_k: int):
        prior = [RANK_PRIOR[min(r, len(RANK_PRIOR) - 1)] for r in range(top_k)]
        picked: list[tuple[float, int, int, int]] = []  # (path prior, parent pick, rank, depth)
        heap = [(-prior[0], 0, -1, 0, 1)]  # (-path prior, tie, parent pick, rank, depth)
        tie = 1
        while heap and len(picked) < max_nodes:
            neg, _, parent, rank, depth = heapq.heappop(heap)
            me = len(picked)
            picked.append((-neg, parent, rank, depth))
            if rank + 1 < top_k:  # the next sibling
                base = 1.0 if parent < 0 else picked[parent][0]
                heapq.heappush(heap, (-base * prior[rank + 1], tie, parent, rank + 1, depth))
                tie += 1
            if depth < max_depth:  # the first child
                heapq.heappush(heap, (neg * prior[0], tie, me, 0, depth + 1))
                tie += 1
        order = sorted(range(len(picked)), key=lambda i: (picked[i][3], i))  # breadth first
        new = {old: j for j, old in enumerate(order)}
        self.parents = [-1 if picked[i][1] < 0 else new[picked[i][1]] for i in order]
        self.ranks = [picked[i][2] for i in order]
        self.depths = [picked[i][3] for i in order]
        self.prior = [prior[r] for r in self.ranks]
        self.levels: list[list[int]] = []
        for j, d in enumerate(self.depths):
            if d > len(self.levels):
                self.levels.append([])
            self.levels[d - 1].append(j)

    def __len__(self) -> int:
        return len(self.parents)

    def signature(self) -> str:
        return f"{len(self)}:{max(self.depths, default=0)}:{hash((tuple(self.parents), tuple(self.ranks)))}"


class AdjacencyTable:
    """token -> its ``top_k`` most recent candidate successors (-1 = none yet), plus per-template-node
    acceptance counts; thread-safe, fixed size (``nbytes``)."""

    def __init__(self, vocab_size: int, top_k: int, template: TreeTemplate, prior_weight: float = 4.0):
        self.vocab_size, self.top_k, self.template = int(vocab_size), int(top_k), template
        self.table = torch.full((self.vocab_size, self.top_k), -1, dtype=torch.int32)  # [vocab, top_k]
        self.prior = torch.tensor(template.prior, dtype=torch.float64)  # [template nodes]
        self.prior_weight = float(prior_weight)
        self.accepted = torch.zeros(len(template), dtype=torch.float64)  # [template nodes] decayed counts
        self.reached = torch.zeros(len(template), dtype=torch.float64)  # ... of steps its parent was accepted
        self.lock = threading.Lock()
        self.updates = 0

    def nbytes(self) -> int:
        """Bytes held: the table and the three per-template-node vectors (all fixed at construction)."""
        tensors = (self.table, self.prior, self.accepted, self.reached)
        return sum(t.numel() * t.element_size() + sys.getsizeof(t) for t in tensors)

    def _estimates(self) -> np.ndarray:
        """[template nodes] (accepted + w * prior) / (reached + w), over numpy views of the counts (a few dozen
        floats, where torch ops cost more than the arithmetic); the caller holds the lock."""
        w = self.prior_weight
        return (self.accepted.numpy() + w * self.prior.numpy()) / (self.reached.numpy() + w)

    def acceptance(self) -> torch.Tensor:
        """[template nodes] estimated acceptance of each node given its parent was accepted."""
        with self.lock:
            return torch.from_numpy(self._estimates())

    def acceptance_of(self, nodes: list[int]) -> list[float]:
        """``acceptance()`` of template nodes ``nodes``, as floats (a drafting step reads a few of them)."""
        with self.lock:
            return self._estimates()[nodes].tolist()

    def expand(self, root: int, depth: int) -> tuple[list[int], list[int], list[int]]:
        """Breadth-first expansion of the template from ``root`` down to ``depth``: (tokens, parents, template
        node) of every node whose token is known; a node without one is dropped with its subtree."""
        template = self.template
        tokens: list[int] = []
        parents: list[int] = []
        nodes: list[int] = []
        at = {-1: 0}  # template node -> draft node (-1: the root)
        token_of = {-1: int(root)}
        with self.lock:
            grid = self.table.numpy()
            for level in template.levels[:depth]:
                live = [j for j in level if template.parents[j] in token_of]
                if not live:
                    break
                # read through the table's numpy view (the same memory; the table stays on the CPU): a few
                # lookups a level, where a torch index over new tensors costs several times more
                found = grid[[token_of[template.parents[j]] for j in live],
                                  [template.ranks[j] for j in live]].tolist()
                for j, token in zip(live, found):
                    if token < 0:
                        continue
                    parent = template.parents[j]
                    at[j] = len(tokens)
                    token_of[j] = token
                    tokens.append(token)
                    parents.append(-1 if parent < 0 else at[parent])
                    nodes.append(j)
        return tokens, parents, nodes

    def update(self, tokens: list[int], candidates: torch.Tensor, rows: list[int] | None = None) -> None:
        """Row ``rows[i]`` (default i) of ``candidates`` [n, top_k] becomes the successors of ``tokens[i]``; a token
        listed twice keeps its last row (callers put the most relevant context last)."""
        last: dict[int, int] = {}
        for i, t in enumerate(tokens):
            if 0 <= t < self.vocab_size:
                last[t] = i if rows is None else rows[i]
        if not last:
            return
        # one copy of the candidates to the table's side (the table stays on the CPU; a no-op for CPU ids), then two
        # numpy fancy indexings, where torch's cost several times more
        successors = candidates.cpu().numpy()[list(last.values())].astype(np.int32)
        with self.lock:
            self.table.numpy()[list(last.keys())] = successors
            self.updates += 1

    def seed(self, tokens: list[int]) -> None:
        """Fill the rows of tokens never seen with the successors they have in ``tokens`` (newest first),
        so a table with no history drafts the prompt's own continuations until the target overwrites them."""
        following: dict[int, list[int]] = {}
        for a, b in zip(reversed(tokens[:-1]), reversed(tokens[1:])):
            if not 0 <= a < self.vocab_size:
                continue
            seen = following.setdefault(a, [])
            if len(seen) < self.top_k and b not in seen:
                seen.append(b)
        with self.lock:
            for a, succ in following.items():
                if int(self.table[a, 0]) < 0:
                    self.table[a, : len(succ)] = torch.tensor(succ, dtype=torch.int32)

    def observe(self, nodes: list[int], reached: list[bool], accepted: list[bool], memory: float) -> None:
        """Template nodes drafted in one step: whether their parent was accepted, whether they were."""
        if not nodes:
            return
        with self.lock:  # numpy views of the counts: a few dozen floats, where torch ops cost more than the sums
            counts, seen = self.accepted.numpy(), self.reached.numpy()
            counts *= memory
            seen *= memory
            np.add.at(counts, nodes, np.asarray(accepted, dtype=np.float64))
            np.add.at(seen, nodes, np.asarray(reached, dtype=np.float64))


class TokenRecyclingProposer:
    """Drafts a tree from the adjacency table (see the module docstring).

    ``top_k``: candidates kept per token; ``template_nodes``, ``max_depth``: the tree template (the paper's has
    80 nodes; a CPU verify forward affords far fewer, and the PFS pruner cuts each step's tree to what pays);
    ``shared``: one table per model shared by every request of the engine (true) or one per request;
    ``seed_from_prompt``: fill rows never seen from the prompt's own bigrams; ``memory``: decay of the
    per-node acceptance counts (per step; 1.0 = never forget)."""

    def __init__(self, top_k: int = 8, template_nodes: int = 48, max_depth: int = 8, shared: bool = True,
                 seed_from_prompt: bool = True, memory: float = 0.995, prior_weight: float = 4.0,
                 name: str = "default"):
        self.top_k = check_int("strategy.propose.top_k", top_k, 1, 64)
        self.reads_top_ids = self.top_k  # learn() reads each verify row's top-k ids (loop.reads_top_ids)
        self.template_nodes = check_int("strategy.propose.template_nodes", template_nodes, 1, 1024)
        self.max_depth = check_k("strategy.propose.max_depth", max_depth)
        if self.max_depth < 1:
            raise ConfigError("strategy.propose.max_depth must be >= 1")
        for flag, value in (("shared", shared), ("seed_from_prompt", seed_from_prompt)):
            if not isinstance(value, bool):
                raise ConfigError(f"strategy.propose.{flag} must be true or false, got {value!r}")
        self.shared, self.seed_from_prompt = shared, seed_from_prompt
        self.memory = float(check_range("strategy.propose.memory", memory, 0, 1, low_inclusive=False))
        self.prior_weight = float(check_range("strategy.propose.prior_weight", prior_weight, 0, None,
                                              low_inclusive=False))
        self.name = str(name)
        self.template = TreeTemplate(self.template_nodes, self.max_depth, self.top_k)
        self.table: AdjacencyTable | None = None
        self.drafts = self.drafted_nodes = self.accepted_nodes = 0

    def _new_table(self, vocab: int) -> AdjacencyTable:
        return AdjacencyTable(vocab, self.top_k, self.template, self.prior_weight)

    @hookimpl
    def on_run_start(self, context) -> dict[str, Any] | None:
        vocab = _vocab_size(context)
        if self.shared and context.shared is not None:
            key = f"token_recycling:{self.name}:{context.model_id}:{vocab}:{self.top_k}:{self.template.signature()}"
            self.table = context.shared.get(key, lambda: self._new_table(vocab))
        else:
            self.table = self._new_table(vocab)
        if self.seed_from_prompt:
            self.table.seed(context.prompt_tokens.tolist())
        return {"recycling_table_bytes": self.table.nbytes(), "recycling_shared": self.shared}

    @hookimpl
    def run_stats(self) -> dict[str, Any]:
        return {"recycling_drafts": self.drafts, "recycling_draft_tokens": self.drafted_nodes,
                "recycling_accepted": self.accepted_nodes}

    def tree(self, state: DecodeState, k: int) -> tuple[list[int], list[int], list[float], list[float], list[int]]:
        """(tokens, parents, node acceptance, PFS, template node) of this step's recycled tree, depth <= k."""
        if self.table is None:
            raise ConfigError("the token recycling proposer was not started (on_run_start did not run)")
        tokens, parents, nodes = self.table.expand(state.root_token, min(k, self.max_depth))
        if not tokens:
            return [], [], [], [], []
        p = self.table.acceptance_of(nodes)
        pfs: list[float] = []
        for i, parent in enumerate(parents):
            pfs.append(p[i] * (1.0 if parent < 0 else pfs[parent]))
        return tokens, parents, p, pfs, nodes

    @hookimpl
    def propose(self, state: DecodeState, k: int) -> Draft:
        tokens, parents, p, pfs, nodes = self.tree(state, k)
        return calibrated_tree(tokens, parents, p, pfs, SOURCE, MARK, [node + 1 for node in nodes])  # template node + 1

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        if self.table is None:
            return
        self.learn(record)

    def learn(self, record: StepRecord) -> None:
        """Recycle the verify forward's top-k into the table; count how each drafted template node fared."""
        draft, verification = record.draft, record.verification
        accepted = record.decision.accepted.tolist()
        if verification is not None:
            logits = verification.logits  # [1 + num_nodes, vocab]
            kept = set(accepted)
            order = [i for i in range(draft.num_nodes) if i not in kept]  # rejected first: least relevant
            rows = [r + 1 for r in order] + [0] + [a + 1 for a in accepted]  # the accepted path last
            inputs = [record.state.root_token] + draft.tokens.tolist()
            k = min(self.top_k, logits.shape[-1])
            # the top-k on the logits' device (a native verify has them already); update copies them to the table's
            # (CPU) side once
            top = verification.top_ids(k)
            if k < self.top_k:
                top = torch.cat([top, top.new_full((top.shape[0], self.top_k - k), -1)], 1)
            self.table.update([inputs[r] for r in rows], top, rows)
        marks = draft.scores.get(MARK)
        if marks is None or not draft.num_nodes:
            return
        kept = set(accepted)
        parents = draft.parents.tolist()
        nodes, reached, hit = [], [], []
        for i, m in enumerate(marks.tolist()):
            if m >= 1:
                nodes.append(int(m) - 1)
                reached.append(parents[i] < 0 or parents[i] in kept)
                hit.append(i in kept)
        # only nodes whose parent was accepted say anything about themselves
        pairs = [(j, h) for j, r, h in zip(nodes, reached, hit) if r]
        self.table.observe([j for j, _ in pairs], [True] * len(pairs), [h for _, h in pairs], self.memory)
        self.drafts += 1
        self.drafted_nodes += len(nodes)
        self.accepted_nodes += sum(hit)


def _vocab_size(context) -> int:
    model = context.model
    if model is not None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and getattr(head, "out_features", None) is not None:
            return int(head.out_features)
        if head is not None and hasattr(head, "weight"):
            return int(head.weight.shape[0])
        size = getattr(getattr(model, "config", None), "vocab_size", None)
        if size:
            return int(size)
    if context.tokenizer is not None:
        return len(context.tokenizer)
    raise ConfigError("token recycling needs the model's vocabulary size")
