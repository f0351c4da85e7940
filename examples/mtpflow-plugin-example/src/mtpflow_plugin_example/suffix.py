"""``SuffixProposer`` (stage ``propose``): SuffixDecoding-style drafts. It matches the end of the text against
the earlier outputs of this process (and, optionally, this request's own prompt and output), merges what
followed the longest matches into a tree weighted by frequency, and drafts its most probable nodes. Repeated or
similar requests (agents, templated answers) get long accepted drafts; no weights, no extra forward.

The index and the frequency tree are mtpflow's own (``mtpflow.suffix_cache``): a plugin builds on the core's
public pieces rather than copying them; the history's policy (``history.py``) and the drafting rule are its own.
"""
from __future__ import annotations

import math

import torch
from mtpflow.errors import ConfigError, check_range
from mtpflow.plugins import hookimpl
from mtpflow.suffix_cache import Occurrence, TokenIndex, frequency_tree
from mtpflow.types import DecodeResult, DecodeState, Draft, StepRecord

from mtpflow_plugin_example.history import HistoryRegistry

SOURCE = "suffix"
# Every run in the process shares these histories: learning from earlier outputs is the point of the proposer.
HISTORIES = HistoryRegistry()


def _positive_int(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not float(check_range(f"strategy.propose.{name}", value, low, None)).is_integer():
        raise ConfigError(f"strategy.propose.{name} must be an integer >= {low}, got {value!r}")
    return int(value)


class SuffixProposer:
    """Draft the most frequent continuations of the longest suffix match over earlier outputs (a tree)."""

    def __init__(self, min_match: int = 2, max_match: int = 16, spec_factor: float = 2.0, min_prob: float = 0.1,
                 max_nodes: int = 16, max_candidates: int = 32, use_request: bool = True,
                 history: str = "default", max_outputs: int = 256):
        self.min_match = _positive_int("min_match", min_match)
        self.max_match = _positive_int("max_match", max_match)
        if self.max_match < self.min_match:
            raise ConfigError(f"strategy.propose: need min_match <= max_match, got {min_match}, {max_match}")
        self.spec_factor = float(check_range("strategy.propose.spec_factor", spec_factor, 0, None,
                                             low_inclusive=False))
        self.min_prob = float(check_range("strategy.propose.min_prob", min_prob, 0, 1))
        self.max_nodes = _positive_int("max_nodes", max_nodes)
        self.max_candidates = _positive_int("max_candidates", max_candidates)
        self.use_request = bool(use_request)
        self.history_name = str(history)
        self.max_outputs = _positive_int("max_outputs", max_outputs)
        self._history = None  # the process-wide OutputHistory for this run's model (set at run start)
        self._live: TokenIndex | None = None  # this request: prompt + output so far
        self._live_id = 0
        self._prompt_tail: list[int] = []
        self._counts = {"suffix_drafts": 0, "suffix_draft_tokens": 0, "suffix_accepted_tokens": 0}

    @hookimpl
    def on_run_start(self, context) -> dict:
        vocab = len(context.tokenizer) if context.tokenizer is not None else 0
        self._history = HISTORIES.get(self.history_name, context.model_id, vocab, self.min_match, self.max_outputs)
        # stored with the output so the next request can match from its very first token (the prompt ends with
        # the chat template's assistant header, shared by every request)
        self._prompt_tail = context.prompt_tokens[-self.max_match:].tolist()
        if self.use_request:
            self._live = TokenIndex(self.min_match)
            self._live_id = self._live.add([])
        return {"suffix_history_outputs": len(self._history)}

    @hookimpl
    def propose(self, state: DecodeState, k: int) -> Draft:
        tail = state.tokens[-self.max_match:].tolist()
        found: list[Occurrence] = []  # each with up to k following tokens; cut to the draft depth below
        if self._history is not None:
            found += self._history.matches(tail, self.max_match, k)
        if self._live is not None:
            seq = self._live.sequences[self._live_id]
            self._live.extend(self._live_id, state.tokens[len(seq):].tolist())
            live = self._live.occurrences(tail, self.max_match, k)
            if state.context_window is not None:  # honour the strategy's sliding window on this request's text
                live = [o for o in live if o.end - o.length >= len(seq) - state.context_window]
            found += live
        if not found:
            return Draft.empty(SOURCE)
        best = max(o.length for o in found)
        depth = min(k, max(1, math.floor(self.spec_factor * best)))
        # newest first: a recent output is the likeliest to repeat; every continuation counts once
        chosen = [o for o in found if o.length == best][: self.max_candidates]
        tree = frequency_tree([(o.continuation[:depth], 1) for o in chosen], self.max_nodes, self.min_prob)
        if not tree.tokens:
            return Draft.empty(SOURCE)
        return Draft(
            tokens=torch.tensor(tree.tokens, dtype=torch.long),
            parents=torch.tensor(tree.parents, dtype=torch.long),
            probs=torch.tensor(tree.probs, dtype=torch.float32),
            source=SOURCE,
            scores={"pfs": torch.tensor(tree.path_probs, dtype=torch.float32)},
        )

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        if record.draft.source == SOURCE and record.draft.num_nodes:
            self._counts["suffix_drafts"] += 1
            self._counts["suffix_draft_tokens"] += record.draft.num_nodes
            self._counts["suffix_accepted_tokens"] += record.decision.num_accepted

    @hookimpl
    def run_stats(self) -> dict:
        """Steps that verified a suffix draft, their draft nodes and accepted tokens, for the run's stats."""
        return dict(self._counts)

    @hookimpl
    def on_run_end(self, result: DecodeResult, status: str) -> None:
        if status == "complete" and self._history is not None and result.token_ids:
            self._history.add(self._prompt_tail + list(result.token_ids))
