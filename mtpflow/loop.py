"""The draft-and-verify decode loop: the only caller of the stage hooks.

One step of one sequence (``Sequence``):
select_k -> propose -> prune -> [verify: one forward] -> gate -> dedup -> rescore -> commit (KV rollback) ->
window -> on_step_end; it stops at EOS, a stop string or max_new_tokens.

``decode_step`` runs that step for every running sequence at once: each plans its own draft with its own
stages, ONE target forward verifies all of them (the engine's backend: ``mtpflow.backends``), then each gates
and commits its own. The engine (``mtpflow.engine``) calls it, for one sequence or many.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import torch

from mtpflow.cost_model import DecayedAcceptance
from mtpflow.errors import MAX_K, UserError
from mtpflow.plugins import hookimpl
from mtpflow.sampling import choose
from mtpflow.target import Target
from mtpflow.types import (
    ACCEPTED, PLAIN, RECOVERED, REJECTED, DEDUPED, DecodeResult, DecodeState, Decision, Draft, RunContext,
    RunStats, StepRecord, Verification,
)

# steps a batch that stopped drafting (its last drafts' sizes said no draft pays) goes without proposing before it
# proposes again: the sizes are refreshed (a lookup that found nothing last time may find a match now) and the
# batch may have shrunk to where drafts pay; the cap after proposing still cuts what does not pay
RETRY_DRAFTS_EVERY = 4
StepCallback = Callable[[StepRecord | None, list[int]], None]


def _close_under_ancestors(keep: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """``keep`` without the nodes whose parent it drops (parents in topological order), over lists: indexing a
    tensor element by element cost more than the rest of a small draft's pruning."""
    out = keep.tolist()
    for i, p in enumerate(parents.tolist()):
        if p >= 0 and not out[p]:
            out[i] = False
    return torch.tensor(out, dtype=torch.bool)


class StageTimer:
    """Times every stage with pluggy wrappers, so no stage needs timing code of its own. The same wrappers (and
    untimed ones around the run hooks) record which stage is running (``running``) and which stage, and which
    plugin in it, an exception came out of (``failure``), so a failed request's one line can name them; the
    engine's report of that failure (``report``: {"error": line, "error_traceback": text}) is put into the
    result's stats before any ``on_run_end`` implementation reads them (the trace recorder stores it)."""

    # the loop's own code between the hooks: Sequence method -> the stage its failures are reported in
    LOOP_STAGES = {"plan": "plan", "cap_draft": "plan", "verify_alone": "verify", "finish": "commit"}

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.running: str | None = None  # the stage hook running now
        self.failure: tuple[BaseException, str, str | None] | None = None  # (exception, stage, plugin or None)
        self.report: dict[str, str] | None = None

    def _timed(self, name, timed=True):
        t0 = time.perf_counter()
        outer, self.running = self.running, name
        try:
            result = yield
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit) and self.stage_of(exc) is None:  # the innermost stage wins
                self.failure = (exc, name, _raised_by(exc, name))
            raise
        finally:
            self.running = outer
        if timed:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        return result

    def stage_of(self, exc: BaseException) -> tuple[str, str | None] | None:
        """(stage, plugin) ``exc`` came out of, if it passed through a stage wrapper or ``blame``."""
        if self.failure is not None and self.failure[0] is exc:
            return self.failure[1], self.failure[2]
        return None

    def blame(self, exc: BaseException) -> None:
        """Record the stage of an exception the loop caught (``decode_step``): the stage hook it came out of,
        else the part of the step whose code raised it (the Sequence method in its traceback)."""
        if self.stage_of(exc) is not None:
            return
        tb = exc.__traceback__
        while tb is not None:
            stage = self.LOOP_STAGES.get(tb.tb_frame.f_code.co_name)
            if stage is not None and isinstance(tb.tb_frame.f_locals.get("self"), Sequence):
                self.failure = (exc, stage, None)
                return
            tb = tb.tb_next

    @hookimpl(wrapper=True)
    def on_run_end(self, result):
        if self.report:
            result.stats.update(self.report)
        return (yield from self._timed("on_run_end", timed=False))


def _stage_wrapper(hook: str, timed: bool) -> Callable:
    """StageTimer's pluggy wrapper of ``hook``: it times the hook (when ``timed``), and records that it runs and
    what failed in it."""
    def wrapper(self):
        return (yield from self._timed(hook, timed=timed))
    wrapper.__name__ = wrapper.__qualname__ = hook
    return hookimpl(wrapper=True)(wrapper)


# the stage hooks are timed; the run hooks only say which hook runs (on_run_end, written out, adds the report)
TIMED_HOOKS = ("select_k", "propose", "prune", "verify", "gate", "dedup", "rescore", "window")
for _hook in TIMED_HOOKS + ("on_run_start", "on_step_end", "run_stats"):
    setattr(StageTimer, _hook, _stage_wrapper(_hook, timed=_hook in TIMED_HOOKS))
del _hook


def _raised_by(exc: BaseException, hook: str) -> str | None:
    """The class (or module) of the innermost implementation of ``hook`` in ``exc``'s traceback: the stage
    object that raised it (wrappers sit further out)."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == hook:
            owner = frame.f_locals.get("self")
            if owner is None:
                found = str(frame.f_globals.get("__name__", "")) or found
            elif not isinstance(owner, StageTimer):
                found = type(owner).__qualname__
        tb = tb.tb_next
    return found


def has_own_verify(plugin_manager) -> bool:
    """True when a strategy or plugin implements ``verify`` (then its sequence verifies alone, not batched)."""
    return any(impl.plugin_name != "mtpflow.core" and not impl.wrapper and not impl.hookwrapper
               for impl in plugin_manager.hook.verify.get_hookimpls())


def reads_only_target_argmax(plugin_manager) -> bool:
    """True when every gate and re-scorer of a run reads nothing of the verify logits but each row's argmax under
    greedy decoding (their plugins say so with ``reads_only_target_argmax = True``, as ``GreedyGate`` and the
    core defaults do): then its verify rows may take the certified LM head."""
    impls = [impl for hook in (plugin_manager.hook.gate, plugin_manager.hook.rescore)
             for impl in hook.get_hookimpls() if not impl.wrapper and not impl.hookwrapper]
    return all(getattr(impl.plugin, "reads_only_target_argmax", False) for impl in impls)


def reads_top_ids(plugin_manager) -> int:
    """How many of each verify row's top ids a run's stages read (``Verification.top_ids``): the most any plugin
    declares with ``reads_top_ids`` (token recycling: its top-k), 0 where none does."""
    return max((int(getattr(plugin, "reads_top_ids", 0) or 0) for plugin in plugin_manager.get_plugins()), default=0)


class Sequence:
    """One request being decoded: its own plugin manager (stage objects built for it alone), its state, its
    KV cache slot and its stats. The engine drives it: ``start`` (prefill), then per step ``plan`` ->
    verification -> ``finish``, then ``end``."""

    def __init__(self, plugin_manager, loaded, backend, context: RunContext, *, stop: tuple[str, ...] = (),
                 need_hidden=False, context_window: int | None = None, pool=None,
                 on_step: StepCallback | None = None, keep_steps: bool = True, prefix_cache=None):
        self.pm = plugin_manager
        self.prefix_cache = prefix_cache  # mtpflow.prefix_cache.PrefixKVCache shared across requests, or None
        self.hook = plugin_manager.hook
        self.loaded = loaded
        self.backend = backend  # mtpflow.backends.Backend: runs this sequence's forwards
        self.context = context
        self.stop = tuple(stop)
        self.need_hidden = need_hidden
        self.context_window = context_window
        self.pool = pool
        self.on_step = on_step
        self.keep_steps = keep_steps
        self.timer = StageTimer()
        plugin_manager.register(self.timer, name="mtpflow.stage_timer")
        self.own_verify = has_own_verify(plugin_manager)
        self.eos = set(loaded.eos_token_ids)
        self.stats = RunStats()
        self.records: list[StepRecord] = []
        self.state: DecodeState | None = None
        self.target: Target | None = None
        self.stop_reason = ""
        self._pending: tuple | None = None
        self._ended = False
        # this sequence's draft acceptance (per position), for the engine's batch-aware cap
        self.acceptance = DecayedAcceptance(prior=0.5)
        self.last_draft_size: int | None = None  # nodes of the last draft it planned (the batch's K forecast)
        self.skipped_plans = 0  # steps in a row it was told not to draft (max_k = 0)

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def stage(self) -> str:
        """Where this sequence is: the stage hook running now (set by the ``StageTimer`` wrappers), else the
        prefill before its first token, the verify forward between ``plan`` and ``finish``, or decode."""
        if self.timer.running:
            return self.timer.running
        if self.state is None:
            return "prefill"
        return "verify" if self._pending is not None else "decode"

    # ----- start: run-start hooks and the prefill ---------------------------------------------------------
    def start(self) -> None:
        """Run-start hooks, the prefill (alone) and the first token; the engine starts several sequences
        together through ``begin``, ``target.prefill_many`` and ``started`` instead."""
        prompt = self.begin()
        if self.prefix_cache is None:
            logits, hidden = self.target.prefill(prompt)
            reused = 0
        else:
            logits, hidden, reused = self.target.prefill_cached(prompt, self.prefix_cache)
        self.started(logits, hidden, reused)

    def begin(self) -> torch.Tensor:
        """Run-start hooks and the KV slot; returns the prompt tokens to prefill."""
        self.t_start = time.perf_counter()
        context, stats = self.context, self.stats
        self.generator = torch.Generator().manual_seed(int(context.seed))
        self._extras: dict[str, Any] = {"rng": self.generator}
        for found in self.hook.on_run_start(context=context):
            if found:
                self._extras.update(found)
                stats.extras.update({k: v for k, v in found.items() if isinstance(v, (int, float, str, bool))})
        limit = self.backend.context_limit
        if limit is not None and int(context.prompt_tokens.numel()) >= limit:
            raise UserError(f"the prompt has {int(context.prompt_tokens.numel())} tokens; the {self.backend.name} "
                            f"backend holds {limit} per sequence (raise model.graph_capacity)")
        self.target = Target(self.backend, need_hidden=self.need_hidden, pool=self.pool)
        self.target.argmax_only = (context.sampling.greedy and reads_only_target_argmax(self.pm)
                                   and self.backend.takes_argmax_only())
        self.target.top_ids = reads_top_ids(self.pm)
        # the backend's self-draft over this sequence's own slot (int8_draft), as a call: stages never hold the target
        self._extras["self_draft"] = self._self_draft
        self._extras["slot_cache"] = self._slot_cache
        self._extras["committed_entries"] = self._committed_entries
        return context.prompt_tokens

    def started(self, logits: torch.Tensor, hidden: torch.Tensor | None, reused: int = 0) -> None:
        """After the prefill (its last row's ``logits``, the prompt's ``hidden`` taps, ``reused`` prompt tokens
        that came from the prefix cache): the first token and the decode state."""
        context, stats = self.context, self.stats
        prompt = context.prompt_tokens
        if reused:
            stats.extras["prefix_cached_tokens"] = reused
        stats.prefill_seconds = time.perf_counter() - self.t_start
        first = choose(logits[-1], context.sampling, self.generator)
        stats.time_to_first_token = time.perf_counter() - self.t_start
        stats.new_tokens = 1
        self.state = DecodeState(
            tokens=torch.cat([prompt, torch.tensor([first], dtype=torch.long)]), prompt_len=int(prompt.numel()),
            step=0, next_position=int(prompt.numel()), sampling=context.sampling,
            max_new_tokens=context.max_new_tokens, hidden=hidden, context_window=self.context_window,
            extras=self._extras,
        )
        if self.on_step:
            self.on_step(None, [first])
        self.stop_reason = "eos" if first in self.eos else ("max_new_tokens" if context.max_new_tokens <= 1 else "")

    def _slot_cache(self):
        """(an HF ``Cache`` view of this sequence's KV slot, its length, the root's position as the model sees it):
        for a draft that runs the target's own first layers over the target's cache (``draft_model`` layers=N)."""
        target = self.target
        return target.cache, target.cache_len, self.state.next_position - target.position_shift

    def _committed_entries(self):
        """(the target's KV pool, this sequence's slot, its length) where entry i holds the key and value of committed
        token i at position i (no entry evicted), else None: a draft model of the same architecture may start its own
        cache from them rather than read the prompt again (``int8_draft``)."""
        target = self.target
        if target.position_shift:
            return None
        return target.pool, target.kv.slot, target.cache_len

    def _self_draft(self, steps: int, layers: int | None = None) -> list[int] | None:
        """``steps`` greedy tokens after this sequence's root from the backend's self-draft, or None where the
        backend has none."""
        target, state = self.target, self.state
        return self.backend.self_draft(target, state.root_token, state.next_position - target.position_shift, steps,
                                       layers)

    # ----- one step, first half: K, draft, pruning ----------------------------------------------------------
    def plan(self, max_k: int | None = None) -> Draft | None:
        """Choose K (at most ``max_k``: the engine's batch-aware K) and draft; None when the sequence cannot
        take another step (its context is full)."""
        state, hook, target = self.state, self.hook, self.target
        t_step = time.perf_counter()
        self.timer.seconds.clear()
        self.skipped_plans = self.skipped_plans + 1 if max_k == 0 else 0
        remaining = self.context.max_new_tokens - state.num_generated
        limit = min(self.loaded.max_context, self.backend.context_limit or self.loaded.max_context)
        room = limit - (state.next_position - target.position_shift) - 1  # see Target.keep
        if room < 0:
            self.stop_reason = "context_full"
            return None
        k = hook.select_k(state=state)
        k = max(0, min(int(k or 0), MAX_K, remaining - 1, room, MAX_K if max_k is None else max_k))
        draft = hook.propose(state=state, k=k) if k > 0 else None
        draft = draft or Draft.empty()
        if not isinstance(draft, Draft):
            raise TypeError(f"propose returned {type(draft).__name__}, not a Draft")
        if draft.num_nodes and draft.max_depth() > k:  # a proposer may not draft deeper than K
            draft = draft.subset(draft.depths() <= k)
        num_proposed = draft.num_nodes
        if draft.num_nodes:
            masks = [m.bool().cpu() for m in hook.prune(state=state, draft=draft) if m is not None]
            if masks:
                keep = masks[0] if len(masks) == 1 else torch.stack(masks).all(0)  # drafts live on the CPU
                keep = _close_under_ancestors(keep, draft.parents)
                if not bool(keep.all()):
                    draft = draft.subset(keep)
        draft = replace(draft, num_proposed=num_proposed)
        if k > 0:
            self.last_draft_size = draft.num_nodes
        self._pending = (t_step, k, draft, num_proposed, target.cache_len)
        return draft

    def cap_draft(self, max_nodes: int) -> Draft:
        """Cut the planned draft to its first ``max_nodes`` nodes (closed under ancestors: nodes are in
        topological order)."""
        t_step, k, draft, num_proposed, cache_start = self._pending
        if draft.num_nodes > max_nodes:
            keep = torch.zeros(draft.num_nodes, dtype=torch.bool)
            keep[:max_nodes] = True
            draft = draft.subset(keep)
            self._pending = (t_step, k, draft, num_proposed, cache_start)
            self.acceptance.forget_rejections()  # an untried draft: the estimate drifts back, so drafting resumes
        return draft

    def verify_alone(self) -> Verification:
        """The ``verify`` hook, for a strategy that brings its own verify forward."""
        _, _, draft, _, _ = self._pending
        return self.hook.verify(state=self.state, draft=draft, target=self.target)

    # ----- one step, second half: gate, dedup, rescore, commit, window, feedback ---------------------------
    def finish(self, verification: Verification) -> list[int]:
        t_step, k, draft, num_proposed, cache_start = self._pending
        self._pending = None
        state, hook, target, stats = self.state, self.hook, self.target, self.stats
        if verification is not None and "verify" not in self.timer.seconds:
            self.timer.seconds["verify"] = verification.forward_seconds  # the shared batch forward
        if verification is not None and verification.fallback is not None:  # named, counted in the run's stats
            fallbacks = stats.extras.setdefault("backend_fallbacks", {})
            fallbacks[verification.fallback] = fallbacks.get(verification.fallback, 0) + 1
        decision = hook.gate(state=state, draft=draft, verification=verification)
        if decision.num_accepted:
            masks = [m for m in hook.dedup(state=state, draft=draft, decision=decision) if m is not None]
            if masks:
                keep = torch.stack([m.bool() for m in masks]).all(0)
                if not bool(keep.all()):
                    cut = int((~keep).nonzero()[0])
                    info = {**decision.info, "deduped_nodes": decision.accepted[cut:].tolist()}
                    decision = replace(decision, accepted=decision.accepted[:cut], next_token=None,
                                       next_kind=RECOVERED, decided_by="rescore", info=info)
        decision = hook.rescore(state=state, draft=draft, verification=verification, decision=decision)

        accepted = decision.accepted
        accepted_list = accepted.tolist()
        path_tokens = draft.tokens[accepted].tolist() if accepted_list else []
        emitted = path_tokens + [int(decision.next_token)]
        kinds = [ACCEPTED] * len(path_tokens) + [PLAIN if draft.num_nodes == 0 else decision.next_kind]
        rows = torch.tensor([0] + [i + 1 for i in accepted_list])  # row that predicted each token
        logits = verification.logits
        target_argmax = verification.target_argmax()
        # probabilities of the few tokens that matter, without a softmax over every row
        log_norm = verification.log_norm()  # [1 + num_nodes]
        target_tokens = target_argmax[rows].tolist()
        target_probs = (logits[rows, torch.tensor(emitted)].float() - log_norm[rows]).exp().tolist()
        if draft.num_nodes:
            parent_rows = torch.where(draft.parents < 0, 0, draft.parents + 1)
            node_probs = (logits[parent_rows, draft.tokens].float() - log_norm[parent_rows]).exp()
        else:
            node_probs = torch.zeros(0)
        decision = replace(decision, node_status=self._node_status(draft, decision, accepted_list))

        target.commit(cache_start, draft.num_nodes, accepted)
        self.stop_reason = self._stop_reason(emitted, state)
        if self.stop_reason:
            emitted, kinds = self._truncate(emitted, kinds, state)
        new_tokens = torch.cat([state.tokens, torch.tensor(emitted, dtype=torch.long)])
        new_hidden = verification.hidden[rows] if verification.hidden is not None else None

        n_emit = len(emitted)
        if draft.num_nodes:
            self.acceptance.update(len(path_tokens), draft.max_depth())
        stats.steps += 1
        stats.new_tokens += n_emit
        stats.draft_tokens += draft.num_nodes
        stats.proposed_tokens += num_proposed
        stats.accepted_tokens += min(len(path_tokens), n_emit)
        stats.hit_steps += n_emit > 1
        stats.k_sum += k
        if self.context.sampling.greedy:
            stats.differs_from_target += sum(int(e != t) for e, t in zip(emitted, target_tokens))

        record = StepRecord(
            step=state.step, k=k, draft=draft, num_proposed=num_proposed, decision=decision,
            emitted=tuple(emitted), emitted_kinds=tuple(kinds), target_tokens=tuple(target_tokens[:n_emit]),
            target_probs=tuple(target_probs[:n_emit]), node_target_argmax=target_argmax,
            node_target_probs=node_probs, forward_seconds=verification.forward_seconds,
            step_seconds=time.perf_counter() - t_step, stage_seconds=dict(self.timer.seconds),
            time_since_start=time.perf_counter() - self.t_start, state=state, verification=verification,
        )
        self.state = replace(
            state, tokens=new_tokens, step=state.step + 1, next_position=state.next_position + n_emit,
            last_k=k, last_accepted=len(path_tokens), last_proposed=draft.num_nodes, hidden=new_hidden,
        )
        keep_index = hook.window(state=self.state, cache_len=target.cache_len)
        if keep_index is not None:
            target.keep(keep_index)
        hook.on_step_end(record=record)
        if self.keep_steps:  # without the verify logits ([1 + num_nodes, vocab] a step): results stay small
            self.records.append(replace(record, verification=None))
        if self.on_step:
            self.on_step(record, emitted)
        return emitted

    # ----- the end -------------------------------------------------------------------------------------------
    def end(self, status: str) -> DecodeResult:
        """Build the result, call ``on_run_end`` once with ``status`` (complete, failed or interrupted) and
        give the KV slot back. Safe to call for a sequence that failed before or during its prefill."""
        if self.state is None:
            result = DecodeResult(text="", token_ids=[], stats={})
        else:
            self.stats.stop_reason = self.stop_reason or status
            result = self.result()
        if self.target is not None:
            self.target.release()
        if not self._ended:
            self._ended = True
            self.hook.on_run_end(result=result, status=status)
        return result

    def result(self) -> DecodeResult:
        stats, state = self.stats, self.state
        stats.total_seconds = time.perf_counter() - self.t_start
        stats.decode_seconds = stats.total_seconds - stats.prefill_seconds
        for extra in self.hook.run_stats():
            stats.extras.update(extra or {})
        ids = state.generated.tolist()
        text = self.loaded.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.stop:
            if s and s in text:
                text = text[: text.index(s)]
        result = DecodeResult(text=text, token_ids=ids, stats=stats.as_dict(), steps=list(self.records))
        result.stats.setdefault("strategy", self.context.strategy)
        if "trace_run_id" in result.stats:
            result.run_id = result.stats["trace_run_id"]
        return result

    @staticmethod
    def _node_status(draft: Draft, decision: Decision, accepted: list[int]) -> tuple[str, ...]:
        """Each node's fate; ``accepted``: ``decision.accepted`` as a list (the loop has it already)."""
        status = [REJECTED] * draft.num_nodes
        for i in accepted:
            status[i] = ACCEPTED
        for i in decision.info.get("deduped_nodes", []):
            status[i] = DEDUPED
        return tuple(status)

    def _stop_reason(self, emitted, state) -> str:
        if any(t in self.eos for t in emitted):
            return "eos"
        if state.num_generated + len(emitted) >= state.max_new_tokens:
            return "max_new_tokens"
        if self.stop:
            tail = self.loaded.tokenizer.decode(state.tokens[-16:].tolist() + list(emitted), skip_special_tokens=True)
            if any(s and s in tail for s in self.stop):
                return "stop_string"
        return ""

    def _truncate(self, emitted, kinds, state):
        """Cut the emitted tokens at the first EOS (kept), the token budget, or the token ending a stop string."""
        out, out_kinds = [], []
        budget = state.max_new_tokens - state.num_generated
        prefix = state.tokens[-16:].tolist()
        tokenizer = self.loaded.tokenizer
        for tok, kind in zip(emitted, kinds):
            if len(out) >= budget:
                break
            out.append(tok)
            out_kinds.append(kind)
            if tok in self.eos:
                break
            if self.stop and any(s and s in tokenizer.decode(prefix + out, skip_special_tokens=True) for s in self.stop):
                break
        return out, out_kinds


def decode_step(sequences: list[Sequence], backend, rows_cap: Callable[[list[Sequence], list[int]], int] | None = None,
                on_error: Callable[[Sequence, BaseException], None] | None = None) -> None:
    """One step for every sequence in ``sequences`` (all started, none done): each plans its draft, ONE
    forward verifies all the drafts, each gates and commits its own. ``rows_cap(sequences, drafts)`` may cap
    the rows per sequence of the shared forward (the engine's batch-aware K: drafts are cut to their first
    ``cap - 1`` nodes, a prefix of a topologically ordered tree is a tree). Before drafting, the same rule runs
    on each sequence's last draft size: when it says no draft pays (cap 1), nobody drafts this step, so the
    batch does not pay for proposals it would cut; every ``RETRY_DRAFTS_EVERY`` such steps they propose again
    (the sizes refresh, and a batch that shrank may now gain from drafts). A sequence whose stage raises is
    handed to ``on_error`` (or the exception propagates) and leaves the step; the others go on."""
    def guarded(seq, fn):
        try:
            return fn()
        except BaseException as exc:  # a stage or a caller's callback (KeyboardInterrupt: cancel) ends it alone
            if on_error is None:
                raise
            seq.timer.blame(exc)  # which stage raised it, for the request's one-line error
            on_error(seq, exc)
            return _FAILED

    max_k = None
    if rows_cap is not None and len(sequences) > 1 and max(s.skipped_plans for s in sequences) < RETRY_DRAFTS_EVERY:
        forecast = [s.last_draft_size for s in sequences]
        if all(n is not None for n in forecast) and rows_cap(sequences, forecast) == 1:
            max_k = 0
            for seq in sequences:  # an untried draft: the estimate drifts back, so drafting is tried again
                seq.acceptance.forget_rejections()
    planned = []
    for seq in sequences:
        draft = guarded(seq, lambda: seq.plan(max_k))
        if draft is not None and draft is not _FAILED:
            planned.append((seq, draft))
    if rows_cap is not None and len(planned) > 1:
        cap = rows_cap([s for s, _ in planned], [d.num_nodes for _, d in planned])
        planned = [(s, s.cap_draft(cap - 1)) for s, _ in planned]
    batched = [(s, d) for s, d in planned if not s.own_verify]
    verifications: dict[int, Verification] = {}
    if batched:
        results = backend.verify([s.target for s, _ in batched], [s.state.root_token for s, _ in batched],
                                 [d for _, d in batched], [s.state.next_position for s, _ in batched])
        verifications = {id(s): v for (s, _), v in zip(batched, results)}
    for seq, _ in planned:
        if seq.own_verify:
            verification = guarded(seq, seq.verify_alone)
            if verification is _FAILED:
                continue
        else:
            verification = verifications[id(seq)]
        guarded(seq, lambda: seq.finish(verification))


_FAILED = object()
