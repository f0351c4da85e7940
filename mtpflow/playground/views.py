"""Neutral per-token and per-step views of a decode, built from live ``StepRecord``s (or from trace rows), so
the live comparison and the history tab render the same way.

A ``TokenView`` is one emitted token with what happened to it (accepted draft, recovered, bonus, plain) and
its scores; a ``StepView`` is one verify step with the draft tokens the gate refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from mtpflow.types import ACCEPTED, PLAIN, StepRecord


@dataclass(frozen=True)
class TokenView:
    token_id: int
    text: str  # the characters this token completes ("" while a multi-byte character is still open)
    kind: str  # ACCEPTED / RECOVERED / BONUS / PLAIN
    step: int  # -1 for the token sampled from the prefill
    depth: int | None = None  # draft depth of an accepted token
    draft_prob: float | None = None
    target_prob: float | None = None
    pfs: float | None = None
    gate_score: float | None = None
    origin: str | None = None  # which drafter proposed an accepted token (e.g. "heads", "prompt lookup")


@dataclass(frozen=True)
class RejectedDraft:
    depth: int
    text: str
    status: str  # REJECTED / DEDUPED / ...
    draft_prob: float | None = None
    target_prob: float | None = None
    pfs: float | None = None
    gate_score: float | None = None


@dataclass(frozen=True)
class StepView:
    step: int
    k: int
    proposed: int  # draft nodes before pruning
    kept: int  # draft nodes sent to the verify forward
    accepted: int  # draft tokens the gate kept
    emitted: int  # tokens committed this step (accepted + recovered/bonus)
    max_depth: int = 0  # deepest draft node offered
    rejected: tuple[RejectedDraft, ...] = ()
    forward_seconds: float = 0.0


@dataclass
class SideView:
    """Everything one pane shows; grows while the decode streams."""

    strategy: str
    tokens: list[TokenView] = field(default_factory=list)
    steps: list[StepView] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    text: str = ""
    error: str | None = None
    run_id: int | None = None
    first_token_seconds: float | None = None  # from the request reaching the server to this side's first token
    done: bool = False


class IncrementalDetokenizer:
    """Text of each new token, with byte-level pieces of one character joined onto the token completing it.

    Decoding a short window (prefix/read offsets, as in text-generation servers) keeps the cost per token
    constant and gives the same text as decoding the whole sequence.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd"):  # an open multi-byte character: the next token completes it
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """What is still held back at the end (bytes that never formed a character)."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


def finish_tokens(tokens: list[TokenView], detok: IncrementalDetokenizer) -> None:
    """Give the held-back tail of the text to the last token, so the tokens spell the whole output."""
    rest = detok.flush()
    if rest and tokens:
        tokens[-1] = replace(tokens[-1], text=tokens[-1].text + rest)


def _item(values, index: int) -> float | None:
    if values is None or index is None or index >= len(values):
        return None
    return float(values[index])


def node_origin(draft, node: int) -> str:
    """Which drafter proposed draft node ``node``: for ``mtp``'s head tree with a grafted lookup chain,
    "heads", "prompt lookup" or "heads + lookup" (both drafted it); else the proposer's name."""
    lookup, grafted = draft.scores.get("lookup"), draft.scores.get("grafted")
    if lookup is None or grafted is None:
        return draft.source or "draft"
    if float(grafted[node]) > 0.5:
        return "prompt lookup"
    return "heads + lookup" if float(lookup[node]) > 0.5 else "heads"


def step_tokens(record: StepRecord | None, emitted: list[int], detok: IncrementalDetokenizer) -> list[TokenView]:
    """TokenViews for the tokens one ``on_step`` callback committed (``record`` is None for the prefill token)."""
    if record is None:
        return [TokenView(int(t), detok.push(t), PLAIN, -1) for t in emitted]
    draft, decision = record.draft, record.decision
    accepted = decision.accepted.tolist()
    depths = draft.depths().tolist() if draft.num_nodes else []
    pfs = draft.scores.get("pfs")
    views = []
    for j, tid in enumerate(emitted):
        kind = record.emitted_kinds[j] if j < len(record.emitted_kinds) else PLAIN
        target_prob = record.target_probs[j] if j < len(record.target_probs) else None
        node = accepted[j] if kind == ACCEPTED and j < len(accepted) else None
        views.append(TokenView(
            token_id=int(tid), text=detok.push(tid), kind=kind, step=record.step,
            depth=None if node is None else depths[node],
            draft_prob=None if node is None else _item(draft.probs, node),
            target_prob=None if target_prob is None else float(target_prob),
            pfs=None if node is None else _item(pfs, node),
            gate_score=None if node is None else _item(decision.gate_scores, node),
            origin=None if node is None else node_origin(draft, node),
        ))
    return views


def step_view(record: StepRecord, tokenizer) -> StepView:
    draft, decision = record.draft, record.decision
    depths = draft.depths().tolist() if draft.num_nodes else []
    pfs = draft.scores.get("pfs")
    rejected = []
    for i, status in enumerate(decision.node_status):
        if status == ACCEPTED:
            continue
        rejected.append(RejectedDraft(
            depth=depths[i], text=tokenizer.decode([int(draft.tokens[i])], skip_special_tokens=False),
            status=status, draft_prob=_item(draft.probs, i), target_prob=_item(record.node_target_probs, i),
            pfs=_item(pfs, i), gate_score=_item(decision.gate_scores, i),
        ))
    return StepView(
        step=record.step, k=record.k, proposed=record.num_proposed, kept=draft.num_nodes,
        accepted=decision.num_accepted, emitted=len(record.emitted),
        max_depth=max(depths) if depths else 0, rejected=tuple(rejected),
        forward_seconds=record.forward_seconds,
    )


def acceptance_by_position(steps: list[StepView]) -> list[tuple[int, int, int]]:
    """(draft position, steps that drafted it, steps that accepted it) for positions 1..max depth."""
    deepest = max((s.max_depth for s in steps), default=0)
    rows = []
    for d in range(1, deepest + 1):
        offered = sum(1 for s in steps if s.max_depth >= d)
        accepted = sum(1 for s in steps if s.max_depth >= d and s.accepted >= d)
        rows.append((d, offered, accepted))
    return rows
