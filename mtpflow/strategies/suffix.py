"""Drafting from the suffix cache (``mtpflow.suffix_cache``, SuffixDecoding): the end of the text is matched
against this request's own prompt and output and against the earlier outputs of the engine (shared across
requests through ``RunContext.shared``); what followed the longest matches is merged into a frequency-scored
tree. Repeated and templated requests (agents, evals, retries) get long accepted drafts; no weights, no extra
forward.

``SuffixProposer`` is the proposer of the ``suffix_cache`` strategy. ``SuffixGraft`` adds the same drafts to any
strategy's proposer (list it under ``plugins:``); ``mtp`` can graft them into its head tree (``suffix:``).
"""
from __future__ import annotations

import math
import threading
from typing import Any

from mtpflow.cost_model import DecayedAcceptance
from mtpflow.errors import ConfigError, check_int, check_range
from mtpflow.plugins import hookimpl
from mtpflow.strategies.graft import calibrated_tree, graft_tree
from mtpflow.suffix_cache import SuffixCache, TokenIndex, frequency_tree
from mtpflow.types import DecodeResult, DecodeState, Draft, StepRecord

SOURCE = "suffix"
MARK = "suffix"  # draft score: 1.0 on the nodes the suffix cache drafted


def match_bucket(length: int) -> int:
    """Acceptance is learned per bucket of match length: 2-3, 4-7, 8-15, 16-31, 32+ (longer, surer)."""
    return min(int(length).bit_length(), 6)


def bucket_prior(bucket: int) -> float:
    """Prior per-token acceptance for a match-length bucket: 0.65 for 2-3 matching tokens up to 0.92 for 32+."""
    return 1.0 - 0.5 * 0.7 ** (bucket - 1)


class SuffixAcceptance:
    """Per-token acceptance of suffix drafts by match-length bucket, shared across requests (calibration shared
    on purpose), thread-safe. A few floats: bounded by construction."""

    def __init__(self, memory: float = 0.9):
        self._estimates = {b: DecayedAcceptance(bucket_prior(b), memory) for b in range(1, 7)}
        self._lock = threading.Lock()

    def value(self, length: int) -> float:
        with self._lock:
            return self._estimates[match_bucket(length)].value

    def update(self, length: int, accepted: int, drafted_depth: int) -> None:
        with self._lock:
            self._estimates[match_bucket(length)].update(accepted, drafted_depth)

    def skipped(self, length: int) -> None:
        with self._lock:
            self._estimates[match_bucket(length)].forget_rejections()


class SuffixDrafter:
    """The drafting logic shared by ``SuffixProposer``, ``SuffixGraft`` and ``mtp``'s ``suffix`` graft.

    ``min_match``/``max_match``: suffix lengths compared (the index anchor is ``min_match`` tokens);
    ``spec_factor``: a match of p tokens drafts at most spec_factor * p positions (SuffixDecoding's MAX_SPEC);
    ``min_prob``: drop nodes whose frequency along the path falls below it; ``max_nodes``: tree size;
    ``max_candidates``: occurrences merged into the tree; ``use_request``: also match this request's own prompt
    and output; ``cache``: name of the engine-wide cache (one per model); ``max_bytes``: its memory bound
    (the first request to create it sets it); ``max_sequence``: tokens stored per output."""

    def __init__(self, min_match: int = 2, max_match: int = 32, spec_factor: float = 2.0, min_prob: float = 0.1,
                 max_nodes: int = 24, max_candidates: int = 32, use_request: bool = True, cache: str = "default",
                 max_bytes: int = 32 << 20, max_sequence: int = 4096, where: str = "strategy.propose"):
        self.min_match = check_int(f"{where}.min_match", min_match, 1, 64)
        self.max_match = check_int(f"{where}.max_match", max_match, 1, 1024)
        if self.max_match < self.min_match:
            raise ConfigError(f"{where}: need min_match <= max_match, got {min_match}, {max_match}")
        self.spec_factor = float(check_range(f"{where}.spec_factor", spec_factor, 0, None, low_inclusive=False))
        self.min_prob = float(check_range(f"{where}.min_prob", min_prob, 0, 1))
        self.max_nodes = check_int(f"{where}.max_nodes", max_nodes, 1, 1024)
        self.max_candidates = check_int(f"{where}.max_candidates", max_candidates, 1, 4096)
        if not isinstance(use_request, bool):
            raise ConfigError(f"{where}.use_request must be true or false, got {use_request!r}")
        self.use_request = use_request
        self.cache_name = str(cache)
        self.max_bytes = check_int(f"{where}.max_bytes", max_bytes, 1024)
        self.max_sequence = check_int(f"{where}.max_sequence", max_sequence, 1)
        self.cache: SuffixCache | None = None  # shared across requests (set at run start)
        self.acceptance: SuffixAcceptance | None = None
        self.live: TokenIndex | None = None  # this request: prompt + output so far
        self._prompt_tail: list[int] = []
        self.last_length: int | None = None  # match length of the latest draft (None: no draft)
        self.counts = {"suffix_drafts": 0, "suffix_draft_tokens": 0, "suffix_accepted": 0}

    def start(self, context) -> dict[str, Any]:
        vocab = len(context.tokenizer) if context.tokenizer is not None else 0
        key = f"suffix_cache:{self.cache_name}:{context.model_id}:{vocab}:{self.min_match}"

        def make_cache() -> SuffixCache:
            return SuffixCache(self.max_bytes, anchor=self.min_match, max_sequence=self.max_sequence)

        shared = context.shared
        if shared is not None:
            self.cache = shared.get(key, make_cache)
            self.acceptance = shared.get(f"{key}:acceptance", SuffixAcceptance)
        else:  # no engine to share with: a cache of this request only
            self.cache, self.acceptance = make_cache(), SuffixAcceptance()
        prompt = context.prompt_tokens.tolist()
        # stored with the output, so a repeated request matches from its first generated token on
        self._prompt_tail = prompt[-self.max_match:]
        if self.use_request:
            self.live = TokenIndex(self.min_match)
            self.live.add(prompt)
        return {"suffix_cache_outputs": len(self.cache), "suffix_cache_bytes": self.cache.nbytes()}

    def tree(self, state: DecodeState, k: int):
        """(tokens, parents, node probabilities, PFS, match length) of this step's suffix tree, depth <= k;
        PFS = learned acceptance ** depth * frequency along the path."""
        self.last_length = None
        if self.cache is None or k < 1:
            return [], [], [], [], 0
        context = state.tokens.tolist()
        tail = context[-self.max_match:]
        found = self.cache.lookup(tail, self.max_match, k)
        if self.live is not None:
            seq = self.live.sequences[0]
            self.live.extend(0, context[len(seq):])
            live = self.live.occurrences(tail, self.max_match, k)
            if state.context_window is not None:  # honour the strategy's sliding window on this request's text
                live = [o for o in live if o.end - o.length >= len(context) - state.context_window]
            found += live
        if not found:
            return [], [], [], [], 0
        best = max(o.length for o in found)
        depth = min(k, max(1, math.floor(self.spec_factor * best)))
        chosen = [o for o in found if o.length == best][: self.max_candidates]
        tree = frequency_tree([(o.continuation[:depth], o.weight) for o in chosen], self.max_nodes, self.min_prob)
        if not len(tree):
            return [], [], [], [], 0
        a = min(self.acceptance.value(best), 0.999)
        depths: list[int] = []
        for p in tree.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        pfs = [a ** d * f for d, f in zip(depths, tree.path_probs)]
        probs = [a * f for f in tree.probs]
        self.last_length = best
        return tree.tokens, tree.parents, probs, pfs, best

    def learn(self, record: StepRecord) -> None:
        """Update the acceptance of this match length from how far the drafted suffix nodes were accepted."""
        length, self.last_length = self.last_length, None
        if length is None:
            return
        draft = record.draft
        marks = draft.scores.get(MARK)
        marked = [] if marks is None or not draft.num_nodes else [m > 0.5 for m in marks.tolist()]
        drafted = sum(marked)
        if drafted == 0:  # pruned away: rejections fade, so this match length is tried again
            self.acceptance.skipped(length)
            return
        depth = max(d for d, m in zip(draft.depth_list(), marked) if m)
        accepted = 0
        for node in record.decision.accepted.tolist():
            if not marked[node]:
                break
            accepted += 1
        self.acceptance.update(length, accepted, depth)
        self.counts["suffix_drafts"] += 1
        self.counts["suffix_draft_tokens"] += drafted
        self.counts["suffix_accepted"] += accepted

    def finish(self, result: DecodeResult, status: str) -> None:
        """A completed request's output joins the shared cache (with the end of its prompt before it)."""
        if status == "complete" and self.cache is not None and result.token_ids:
            self.cache.add(self._prompt_tail + list(result.token_ids))
        self.live = None


class _SuffixHooks:
    """The hooks a suffix-cache stage shares, whether it drafts alone or grafts: start, learn from each step,
    count, and add the finished output to the cache (``self.drafter`` is a ``SuffixDrafter``)."""

    drafter: SuffixDrafter

    @hookimpl
    def on_run_start(self, context) -> dict[str, Any]:
        return self.drafter.start(context)

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        self.drafter.learn(record)

    @hookimpl
    def run_stats(self) -> dict[str, Any]:
        return dict(self.drafter.counts)

    @hookimpl
    def on_run_end(self, result: DecodeResult, status: str) -> None:
        self.drafter.finish(result, status)


class SuffixProposer(_SuffixHooks):
    """The ``suffix_cache`` proposer: a frequency-scored tree from the suffix cache (see ``SuffixDrafter``).
    Its nodes carry an acceptance estimate as PFS, marked calibrated, so the cost-aware PFS pruner keeps the
    part that pays for its verify cost."""

    def __init__(self, **options):
        self.drafter = SuffixDrafter(**options)

    @hookimpl
    def propose(self, state: DecodeState, k: int) -> Draft:
        tokens, parents, probs, pfs, _ = self.drafter.tree(state, k)
        return calibrated_tree(tokens, parents, probs, pfs, SOURCE, MARK)


class SuffixGraft(_SuffixHooks):
    """Adds suffix-cache drafts to whatever the strategy's proposer drafts (a ``propose`` wrapper): list it
    under a strategy's ``plugins:``, e.g. ``strategy.plugins=[{_target_: mtpflow.strategies.suffix.SuffixGraft}]``.
    The proposer's own nodes keep their indices; the suffix tree is merged in from the root (``graft_tree``).
    Options as ``SuffixDrafter``; ``max_nodes`` bounds the grafted tree. Without a pruner every grafted node is
    verified, so the graft keeps only nodes whose estimated acceptance is at least ``min_pfs``."""

    def __init__(self, min_pfs: float = 0.3, **options):
        self.min_pfs = float(check_range("strategy.plugins.min_pfs", min_pfs, 0, 1))
        self.drafter = SuffixDrafter(where="strategy.plugins", **options)

    @hookimpl(wrapper=True)
    def propose(self, state: DecodeState, k: int):
        draft = yield
        draft = draft if draft is not None else Draft.empty()
        tokens, parents, _, pfs, _ = self.drafter.tree(state, k)
        keep = [i for i, p in enumerate(pfs) if p >= self.min_pfs]  # closed under ancestors: PFS only falls
        if not keep:
            self.drafter.last_length = None
            return draft
        remap = {old: new for new, old in enumerate(keep)}
        return graft_tree(draft, [tokens[i] for i in keep], [remap.get(parents[i], -1) for i in keep],
                          [pfs[i] for i in keep], MARK)

