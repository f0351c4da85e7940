"""Typed values that flow between the stages of one decoding step.

Every stage receives these read-only and returns a new value (or ``None`` to abstain); the loop in
``mtpflow.loop`` is the only code that builds a new ``DecodeState``. Shapes are given in comments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Token statuses used by traces and the playground.
ACCEPTED = "accepted"  # a draft token the gate kept
RECOVERED = "recovered"  # the target's token put at the first rejected position
BONUS = "bonus"  # the extra target token after a fully accepted path
PLAIN = "plain"  # an autoregressive token: no draft was proposed this step
REJECTED = "rejected"  # a draft token the gate refused
PRUNED = "pruned"  # a draft node a pruner dropped before the verify forward
DEDUPED = "deduped"  # a draft token the gate kept but dedup refused


@dataclass(frozen=True)
class SamplingParams:
    """How the target distribution is formed. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DecodeState:
    """What stages may look at: the committed text so far and feedback from the last step.

    The KV cache holds every committed token except the last one (the *root*): each verify forward feeds
    the root followed by the draft nodes, so the root's logits score the first draft position.
    """

    tokens: torch.Tensor  # [prompt_len + generated] committed token ids (long, on CPU)
    prompt_len: int
    step: int  # index of the step about to run (0-based)
    next_position: int  # position id of the root token
    sampling: SamplingParams
    max_new_tokens: int
    last_k: int = 0  # K chosen in the previous step
    last_accepted: int = 0  # draft tokens accepted in the previous step
    last_proposed: int = 0  # draft tokens proposed in the previous step
    # [n, hidden] target last-layer hidden states at the inputs of the previous forward that were kept: after
    # the prefill every prompt token; after a step the old root plus the accepted nodes. Row i predicted the
    # token after input i, so the last row produced the root. None unless the strategy sets
    # ``needs_hidden_states: true``.
    hidden: torch.Tensor | None = None
    context_window: int | None = None  # proposers should look at only the last N tokens, if set
    # run-level facts (e.g. domain, the run's "rng", the "target" whose KV cache a self-draft shares), read-only
    # for stages
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def generated(self) -> torch.Tensor:
        return self.tokens[self.prompt_len :]

    @property
    def num_generated(self) -> int:
        return int(self.tokens.numel()) - self.prompt_len

    @property
    def root_token(self) -> int:
        return int(self.tokens[-1])

    def proposer_context(self) -> torch.Tensor:
        """The tokens a proposer may look at, honouring the sliding window."""
        if self.context_window is None or self.tokens.numel() <= self.context_window:
            return self.tokens
        return self.tokens[-self.context_window :]


@dataclass(frozen=True)
class Draft:
    """Proposed tokens after the root: a chain (every parent is the previous node) or a tree.

    Nodes are in topological order (a parent comes before its children).
    """

    tokens: torch.Tensor  # [num_nodes] long draft token ids
    parents: torch.Tensor  # [num_nodes] long parent node index, -1 for a child of the root
    # [num_nodes] draft probability of each node's token given its path (1.0 for deterministic proposers)
    probs: torch.Tensor | None = None
    # [num_nodes, vocab] the full draft distribution each node was drawn from, for speculative sampling
    # with stochastic proposers; None means the draft is deterministic.
    dists: torch.Tensor | None = None
    source: str = ""  # name of the proposer
    scores: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. {"pfs": [num_nodes]}
    num_proposed: int | None = None  # nodes before pruning (set by the loop)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_chain(self) -> bool:
        n = self.num_nodes
        return bool(torch.equal(self.parents, torch.arange(-1, n - 1, dtype=self.parents.dtype)))

    def depths(self) -> torch.Tensor:
        """[num_nodes] depth of each node, 1 for children of the root."""
        return torch.tensor(self.depth_list(), dtype=torch.long)

    def depth_list(self) -> list[int]:
        """``depths`` as Python ints (for callers that build their own lists). Computed once per draft: the loop, the
        backend and several stages read it each step. Callers must not modify it."""
        depth = self.__dict__.get("_depths")
        if depth is None:
            parents = self.parents.tolist()
            depth = [0] * len(parents)
            for i, p in enumerate(parents):
                depth[i] = 1 if p < 0 else depth[p] + 1
            object.__setattr__(self, "_depths", depth)  # a cache, not a field: the draft stays frozen
        return depth

    def max_depth(self) -> int:
        """The deepest node's depth (0 for an empty draft)."""
        return max(self.depth_list(), default=0)

    def subset(self, keep: torch.Tensor) -> Draft:
        """The draft restricted to ``keep`` ([num_nodes] bool, closed under ancestors), parents reindexed."""
        idx = keep.nonzero().flatten()
        remap = torch.full((self.num_nodes + 1,), -1, dtype=torch.long)
        remap[idx] = torch.arange(idx.numel())
        new_parents = torch.where(self.parents[idx] < 0, -1, remap[self.parents[idx].clamp(min=0)])
        return Draft(
            tokens=self.tokens[idx],
            parents=new_parents,
            probs=None if self.probs is None else self.probs[idx],
            dists=None if self.dists is None else self.dists[idx],
            source=self.source,
            scores={k: v[idx] for k, v in self.scores.items()},
            num_proposed=self.num_proposed,
        )

    @staticmethod
    def empty(source: str = "") -> Draft:
        return Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), source=source)

    @staticmethod
    def chain(tokens: list[int] | torch.Tensor, source: str = "", probs: torch.Tensor | None = None) -> Draft:
        t = torch.as_tensor(tokens, dtype=torch.long).flatten()
        return Draft(t, torch.arange(-1, t.numel() - 1, dtype=torch.long), probs=probs, source=source)


@dataclass(frozen=True)
class Verification:
    """The target's view of the draft, from one forward over the root and all draft nodes."""

    # [1 + num_nodes, vocab] float32; row 0 is the root, row i + 1 is draft node i. For a sequence with
    # ``Target.argmax_only`` (greedy, argmax-only gate and re-scorer) the LM head may be the certified one
    # (mtpflow.backends.native.certified_head): each row's argmax and the entries near it exact, the rest within a bound
    logits: torch.Tensor
    hidden: torch.Tensor | None  # [1 + num_nodes, hidden] last-layer hidden states, if requested
    forward_seconds: float
    # the backend's fast path declined this forward and a slower one computed it (``Backend.fall_back``): why
    fallback: str | None = None

    def target_argmax(self) -> torch.Tensor:
        """[1 + num_nodes] the target's greedy choice after each row (computed once: the gate and the loop
        both read it, and each call is an argmax over every row's vocabulary). Callers must not modify it."""
        argmax = self.__dict__.get("_target_argmax")
        if argmax is None:
            argmax = self.logits.argmax(dim=-1)
            object.__setattr__(self, "_target_argmax", argmax)  # a cache, not a field: the value stays frozen
        return argmax

    def log_norm(self) -> torch.Tensor:
        """[1 + num_nodes] float32 log of each row's softmax normalizer, logsumexp(logits) (computed once: a
        token's probability after row r is exp(logits[r, token] - log_norm[r])). Callers must not modify it."""
        log_norm = self.__dict__.get("_log_norm")
        if log_norm is None:
            log_norm = torch.logsumexp(self.logits.float(), dim=-1)
            object.__setattr__(self, "_log_norm", log_norm)
        return log_norm

    def top_ids(self, k: int) -> torch.Tensor:
        """[1 + num_nodes, k] the ids of each row's k largest logits, largest first (the set torch.topk gives; among
        equal logits the order may differ). Callers must not modify it."""
        known = self.__dict__.get("_top_ids")
        if known is not None and known.shape[-1] >= k:
            return known[:, :k]
        return self.logits.topk(k, dim=-1).indices

    def with_row_stats(self, argmax: torch.Tensor, log_norm: torch.Tensor,
                       top_ids: torch.Tensor | None = None) -> Verification:
        """This verification with ``target_argmax()``, ``log_norm()`` and (given) the first ``top_ids`` already
        known: a backend that computed them with the logits (one pass while the rows are in cache,
        ``mtpflow.backends.native``) hands them over."""
        object.__setattr__(self, "_target_argmax", argmax)
        object.__setattr__(self, "_log_norm", log_norm)
        if top_ids is not None:
            object.__setattr__(self, "_top_ids", top_ids)
        return self


@dataclass(frozen=True)
class Decision:
    """What to commit: the accepted path through the draft and the token that follows it."""

    accepted: torch.Tensor  # [n_accepted] node indices of the accepted root-to-node path, in depth order
    next_token: int | None  # recovered or bonus token after the path; None asks the re-scorer to fill it
    next_kind: str = RECOVERED  # RECOVERED or BONUS (PLAIN when the draft was empty)
    # [num_nodes] per-node gate score (e.g. target probability or composite score), for traces
    gate_scores: torch.Tensor | None = None
    # [num_nodes] status of every draft node (ACCEPTED / REJECTED / DEDUPED / ...), filled by the loop
    node_status: tuple[str, ...] = ()
    decided_by: str = "gate"  # stage that decided next_token: "gate" or "rescore"
    info: dict[str, Any] = field(default_factory=dict)  # gate-specific facts for traces

    @property
    def num_accepted(self) -> int:
        return int(self.accepted.numel())


@dataclass(frozen=True)
class RunContext:
    """Facts about a run, for ``on_run_start`` hooks."""

    prompt: str
    prompt_tokens: torch.Tensor  # [prompt_len]
    strategy: str
    model_id: str
    device: str
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    config: dict[str, Any] = field(default_factory=dict)  # the fully resolved config
    tokenizer: Any = None
    model: Any = None
    # objects shared on purpose across the requests of one engine (mtpflow.shared.SharedState): a suffix
    # cache, calibration. Everything else a stage holds belongs to its own sequence.
    shared: Any = None
    # the engine's backend (mtpflow.backends.Backend): what runs the target's forwards; cost measurements key on
    # its ``describe()``
    backend: Any = None


@dataclass(frozen=True)
class StepRecord:
    """Everything that happened in one step, handed to ``on_step_end`` (feedback, metrics, traces)."""

    step: int
    k: int
    draft: Draft  # after pruning
    num_proposed: int  # nodes the proposer drafted
    decision: Decision
    emitted: tuple[int, ...]  # token ids committed this step (accepted path + next token, truncated at stop)
    emitted_kinds: tuple[str, ...]  # ACCEPTED / RECOVERED / BONUS / PLAIN per emitted token
    target_tokens: tuple[int, ...]  # the target's own greedy choice at each emitted position
    target_probs: tuple[float, ...]  # target probability of each emitted token
    node_target_argmax: torch.Tensor  # [1 + num_nodes] target argmax after the root and each node
    node_target_probs: torch.Tensor  # [num_nodes] target probability of each draft node's token
    forward_seconds: float
    step_seconds: float
    stage_seconds: dict[str, float]
    time_since_start: float  # seconds from run start to the end of this step
    state: DecodeState  # the state the step started from
    # the target's verify forward of this step (logits of the root and every draft node), e.g. for drafters
    # that learn from the target's top-k (token recycling)
    verification: Verification | None = None


@dataclass
class RunStats:
    """Summary numbers of one decode."""

    new_tokens: int = 0
    steps: int = 0  # verify forwards
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    time_to_first_token: float = 0.0
    draft_tokens: int = 0  # draft nodes sent to the verify forward
    proposed_tokens: int = 0  # draft nodes before pruning
    accepted_tokens: int = 0  # draft tokens accepted (committed)
    hit_steps: int = 0  # steps that emitted more than one token
    k_sum: int = 0
    differs_from_target: int = 0  # emitted tokens that are not the target's own greedy choice
    stop_reason: str = ""
    extras: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        new = max(self.new_tokens, 1)
        d = {
            "new_tokens": self.new_tokens,
            "forward_passes": self.steps + 1,  # verify forwards + the prefill
            "verify_forwards": self.steps,
            # tokens per verify forward, bonus/recovered included; the first token comes from the prefill
            "mal": round((self.new_tokens - 1) / steps, 4) if self.steps else 0.0,
            "tokens_per_second": round(self.new_tokens / self.total_seconds, 3) if self.total_seconds else 0.0,
            "acceptance_rate": round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else 0.0,
            # draft nodes kept by the pruners / nodes proposed (1.0 when nothing is pruned)
            "compression_rate": round(self.draft_tokens / self.proposed_tokens, 4) if self.proposed_tokens else 1.0,
            "time_to_first_token": round(self.time_to_first_token, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "total_seconds": round(self.total_seconds, 4),
            "draft_tokens": self.draft_tokens,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mtp_hit_rate": round(self.hit_steps / steps, 4) if self.steps else 0.0,
            "mtp_avg_k_used": round(self.k_sum / steps, 4) if self.steps else 0.0,
            "mtp_error_propagation_rate": round(self.differs_from_target / new, 4),
            "forward_passes_per_token": round((self.steps + 1) / new, 4),
            "stop_reason": self.stop_reason,
        }
        d.update(self.extras)
        return d


@dataclass
class DecodeResult:
    text: str
    token_ids: list[int]
    stats: dict[str, Any]
    steps: list[StepRecord] = field(default_factory=list)
    run_id: int | None = None


def strategy_label(strategy) -> str:
    """How runs, stats and traces name a strategy node: its ``name``, and for one chosen by measurement
    (``mtpflow.strategy_choice``) the candidate that runs as well: ``mtp -> suffix_cache``."""
    name = str(strategy.get("name", "?"))
    chosen = strategy.get("chosen")
    return f"{name} -> {chosen}" if chosen else name


# ----- what a strategy asks of the forwards: read from its config when a request is checked, so checking one
# needs no forward module
def hidden_taps(model, spec) -> tuple[int, ...]:
    """A strategy's ``needs_hidden_states`` -> which hidden states a forward returns, in order (concatenated on
    the last dimension): ``()`` none; ``-1`` the last hidden state after the final norm (``true``); ``i`` in
    ``0..L-2`` the output of decoder layer i (HF's ``hidden_states[i + 1]``; the last layer's is -1, normed).
    ``eagle3`` is EAGLE-3's low, middle and high layers (2, L // 2, L - 3 of L layers, clipped to 0..L-2 for
    tiny models); a list names the taps itself."""
    if spec is None or spec is False:
        return ()
    if spec is True:
        return (-1,)
    layers = int(getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "num_hidden_layers"))
    if isinstance(spec, str):
        if spec != "eagle3":
            raise ValueError(f"needs_hidden_states must be true, false, eagle3 or a list of layers, got {spec!r}")
        if layers < 2:
            return (-1,)
        return tuple(sorted({max(0, min(t, layers - 2)) for t in (2, layers // 2, layers - 3)}))
    taps = tuple(int(t) for t in spec)
    if not taps or any(t < -1 or t >= layers - 1 for t in taps):
        raise ValueError(f"needs_hidden_states layers must be -1 or 0..{layers - 2}, got {list(taps)}")
    return taps
