"""The composite confidence gate (stage ``gate``, lossy): each draft token gets a weighted sum of local
confidence (the target's probability of it), global consistency (bigram co-occurrence statistics from a
corpus) and semantic coherence (embedding similarity of the continuation to the context, using the target's
own input embeddings), and the path is accepted while that score stays at or above the threshold."""
from __future__ import annotations

import functools

import torch

from mtpflow.errors import ConfigError, UserError, check_range
from mtpflow.plugins import hookimpl
from mtpflow.kernels import children_lists
from mtpflow.strategies.ngram_stats import BigramTable, default_table_path, tokenizer_fingerprint
from mtpflow.types import BONUS, RECOVERED, Decision, DecodeState, Draft, Verification

NO_TABLE = (None, "", "none", "null")
LOCAL_MODES = ("relative", "probability")


@functools.lru_cache(maxsize=4)
def _load_table(path: str) -> BigramTable:
    return BigramTable.load(path)


@functools.lru_cache(maxsize=4)
def _fingerprint(tokenizer) -> str:
    return tokenizer_fingerprint(tokenizer)


class CompositeConfidenceGate:
    """Accept a draft token while ``w_l * local + w_g * global + w_s * semantic >= threshold``.

    All three parts lie in [0, 1] and the weights are normalised to sum to 1, so the score does too:
    - local: the target's softmax probability of the token (at the sampling temperature, 1 when greedy),
      divided by the top probability at that position when ``local_confidence=relative`` (the default: the
      target's own choice scores 1 even where the target is unsure, so the gate judges the draft rather than
      the target's certainty), or taken as is with ``local_confidence=probability``;
    - global: ``BigramTable.score(previous token, token)``, log-scaled co-occurrence count;
    - semantic: cosine similarity (clipped at 0) between the mean embedding of the continuation (the path
      from the root's child to this token) and the mean embedding of the last ``semantic_context``
      committed tokens, both centred on the vocabulary's mean embedding (raw token embeddings share one
      large common direction that makes every cosine look alike).
    In a tree the best-scoring child that passes is followed. The gate leaves ``next_token`` to the
    re-scorer. Lossy: the run records the error propagation rate.
    """

    def __init__(self, threshold: float = 0.82, local_weight: float = 0.8, global_weight: float = 0.1,
                 semantic_weight: float = 0.1, ngram_table: str | None = "default", semantic_context: int = 64,
                 local_confidence: str = "relative"):
        if local_confidence not in LOCAL_MODES:
            raise ConfigError(f"strategy.gate.local_confidence must be one of {', '.join(LOCAL_MODES)}, "
                              f"got {local_confidence!r}")
        self.local_confidence = local_confidence
        self.threshold = float(check_range("strategy.gate.threshold", threshold, 0, 1))
        weights = [float(check_range(f"strategy.gate.{n}", w, 0, None))
                   for n, w in (("local_weight", local_weight), ("global_weight", global_weight),
                                ("semantic_weight", semantic_weight))]
        if sum(weights) <= 0:
            raise ConfigError("strategy.gate: the local, global and semantic weights must not all be 0")
        self.local_weight, self.global_weight, self.semantic_weight = (w / sum(weights) for w in weights)
        if isinstance(semantic_context, bool) or not isinstance(semantic_context, int) or semantic_context < 1:
            raise ConfigError(f"strategy.gate.semantic_context must be a positive integer, got {semantic_context!r}")
        self.semantic_context = semantic_context
        self.table: BigramTable | None = None
        if ngram_table in NO_TABLE:
            if self.global_weight > 0:
                raise ConfigError("strategy.gate.global_weight > 0 needs an ngram_table")
        else:
            path = default_table_path() if ngram_table == "default" else ngram_table
            self.table = _load_table(str(path))
        self.embeddings: torch.Tensor | None = None  # [vocab, hidden] the target's input embeddings
        self.embedding_mean: torch.Tensor | None = None  # [hidden]

    @hookimpl
    def on_run_start(self, context) -> None:
        if self.table is not None and context.tokenizer is not None and self.table.fingerprint:
            if _fingerprint(context.tokenizer) != self.table.fingerprint:
                raise UserError("strategy.gate.ngram_table was built for another tokenizer; rebuild it with "
                                "`python -m mtpflow.strategies.ngram_stats --model <model> --out <file>`")
        if self.semantic_weight > 0 and context.model is not None:
            weight = context.model.get_input_embeddings().weight
            self.embeddings = weight.detach()
            self.embedding_mean = self.embeddings.float().mean(0)

    def _semantic(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """[num_nodes] clipped cosine of the centred mean embedding of each path against the context."""
        if self.embeddings is None:
            return torch.zeros(draft.num_nodes)
        mu = self.embedding_mean
        context = self.embeddings[state.tokens[-self.semantic_context:].to(self.embeddings.device)].float()
        context_vec = context.mean(0) - mu
        node_emb = self.embeddings[draft.tokens.to(self.embeddings.device)].float() - mu  # [num_nodes, hidden]
        path_sum = torch.zeros_like(node_emb)
        for i, p in enumerate(draft.parents.tolist()):  # topological order: a parent's sum is ready
            path_sum[i] = node_emb[i] + (path_sum[p] if p >= 0 else 0)
        depth = draft.depths().to(path_sum).unsqueeze(1)
        cos = torch.nn.functional.cosine_similarity(path_sum / depth, context_vec[None], dim=-1)
        return cos.clamp(min=0).cpu()

    def node_scores(self, state: DecodeState, draft: Draft, verification: Verification) -> dict[str, torch.Tensor]:
        """{"local", "global", "semantic", "score"}: [num_nodes] each, for every draft node."""
        n = draft.num_nodes
        parents = draft.parents
        rows = torch.where(parents < 0, 0, parents + 1)
        temperature = state.sampling.temperature or 1.0
        probs = (verification.logits.float() / temperature).softmax(-1)  # on the logits' device
        on = probs.device
        local = probs[rows.to(on), draft.tokens.to(on)]
        if self.local_confidence == "relative":
            local = local / probs[rows.to(on)].max(-1).values
        local = local.cpu()  # scores live on the CPU with the draft: the n-gram part is built there
        prev = torch.where(parents < 0, torch.tensor(state.root_token), draft.tokens[parents.clamp(min=0)])
        if self.table is not None and self.global_weight > 0:
            glob = torch.tensor([self.table.score(a, b) for a, b in zip(prev.tolist(), draft.tokens.tolist())])
        else:
            glob = torch.zeros(n)
        semantic = self._semantic(state, draft) if self.semantic_weight > 0 else torch.zeros(n)
        score = self.local_weight * local + self.global_weight * glob + self.semantic_weight * semantic
        return {"local": local, "global": glob, "semantic": semantic, "score": score}

    @hookimpl
    def gate(self, state: DecodeState, draft: Draft, verification: Verification) -> Decision:
        if draft.num_nodes == 0:
            return Decision(torch.zeros(0, dtype=torch.long), None, RECOVERED, gate_scores=torch.zeros(0),
                            info={"lossy": True})
        parts = self.node_scores(state, draft, verification)
        score = parts["score"]
        root, kids = children_lists(draft.parents.tolist())
        path: list[int] = []
        options = root
        while options:
            best = max(options, key=lambda c: float(score[c]))
            if float(score[best]) < self.threshold:
                break
            path.append(best)
            options = kids[best]
        leaf = bool(path) and not kids[path[-1]]
        info = {"lossy": True, "threshold": self.threshold,
                **{k: [round(float(v), 4) for v in parts[k]] for k in ("local", "global", "semantic")}}
        return Decision(torch.tensor(path, dtype=torch.long), None, BONUS if leaf else RECOVERED,
                        gate_scores=score, info=info)
