"""The draft-and-verify decode loop: the only caller of the stage hooks.

prefill -> per step: select_k -> propose -> prune -> verify (one forward) -> gate -> dedup -> rescore ->
commit (KV rollback) -> window -> on_step_end; stop at EOS, a stop string or max_new_tokens.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import torch

from mtpflow.hookspecs import hookimpl
from mtpflow.sampling import choose
from mtpflow.target import Target
from mtpflow.types import (
    ACCEPTED, BONUS, DEDUPED, PLAIN, RECOVERED, REJECTED, DecodeResult, DecodeState, Decision, Draft,
    RunContext, RunStats, StepRecord,
)

MAX_K = 64  # upper bound on draft depth accepted from any K selector


def _close_under_ancestors(keep: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    keep = keep.clone()
    for i, p in enumerate(parents.tolist()):
        if p >= 0 and not keep[p]:
            keep[i] = False
    return keep


class StageTimer:
    """Times every stage with pluggy wrappers, so no stage needs timing code of its own."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def _timed(self, name):
        t0 = time.perf_counter()
        result = yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        return result

    @hookimpl(wrapper=True)
    def select_k(self):
        return (yield from self._timed("select_k"))

    @hookimpl(wrapper=True)
    def propose(self):
        return (yield from self._timed("propose"))

    @hookimpl(wrapper=True)
    def prune(self):
        return (yield from self._timed("prune"))

    @hookimpl(wrapper=True)
    def verify(self):
        return (yield from self._timed("verify"))

    @hookimpl(wrapper=True)
    def gate(self):
        return (yield from self._timed("gate"))

    @hookimpl(wrapper=True)
    def dedup(self):
        return (yield from self._timed("dedup"))

    @hookimpl(wrapper=True)
    def rescore(self):
        return (yield from self._timed("rescore"))

    @hookimpl(wrapper=True)
    def window(self):
        return (yield from self._timed("window"))


class DecodeLoop:
    """Runs one decode with a per-run plugin manager (the strategy's stages plus core defaults)."""

    def __init__(self, plugin_manager, loaded, need_hidden: bool = False, context_window: int | None = None):
        self.pm = plugin_manager
        self.hook = plugin_manager.hook
        self.loaded = loaded
        self.need_hidden = need_hidden
        self.context_window = context_window
        self.timer = StageTimer()
        plugin_manager.register(self.timer, name="mtpflow.stage_timer")

    def run(self, context: RunContext, stop: tuple[str, ...] = (),
            on_step: Callable[[StepRecord, list[int]], None] | None = None) -> DecodeResult:
        status = "failed"
        result = DecodeResult(text="", token_ids=[], stats={})
        try:
            result = self._run(context, stop, on_step)
            status = "complete"
            return result
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            if status != "complete":
                result = self._partial
            self.hook.on_run_end(result=result, status=status)

    def _run(self, context: RunContext, stop: tuple[str, ...], on_step) -> DecodeResult:
        t_start = time.perf_counter()
        loaded, hook = self.loaded, self.hook
        tokenizer = loaded.tokenizer
        eos = set(loaded.eos_token_ids)
        generator = torch.Generator().manual_seed(int(context.seed))
        stats = RunStats()
        self._partial = DecodeResult(text="", token_ids=[], stats={})
        extras: dict[str, Any] = {"rng": generator}
        for found in hook.on_run_start(context=context):
            if found:
                extras.update(found)
                stats.extras.update({k: v for k, v in found.items() if isinstance(v, (int, float, str, bool))})

        prompt = context.prompt_tokens
        target = Target(loaded.model, need_hidden=self.need_hidden)
        extras["target"] = target  # read by stages that share its KV cache (the self-draft of draft_model)
        logits, hidden = target.prefill(prompt)
        stats.prefill_seconds = time.perf_counter() - t_start
        first = choose(logits[-1], context.sampling, generator)
        tokens = torch.cat([prompt, torch.tensor([first], dtype=torch.long)])
        stats.time_to_first_token = time.perf_counter() - t_start
        stats.new_tokens = 1
        records: list[StepRecord] = []
        state = DecodeState(
            tokens=tokens, prompt_len=int(prompt.numel()), step=0, next_position=int(prompt.numel()),
            sampling=context.sampling, max_new_tokens=context.max_new_tokens,
            hidden=hidden, context_window=self.context_window, extras=extras,
        )
        if on_step:
            on_step(None, [first])
        stop_reason = "eos" if first in eos else ("max_new_tokens" if context.max_new_tokens <= 1 else "")
        max_context = loaded.max_context

        while not stop_reason:
            t_step = time.perf_counter()
            self.timer.seconds.clear()
            remaining = context.max_new_tokens - state.num_generated
            room = max_context - (state.next_position - target.position_shift) - 1  # shift: see Target.keep
            if room < 0:
                stop_reason = "context_full"
                break
            k = hook.select_k(state=state)
            k = max(0, min(int(k or 0), MAX_K, remaining - 1, room))
            draft = hook.propose(state=state, k=k) if k > 0 else None
            draft = draft or Draft.empty()
            depth = draft.depths() if draft.num_nodes else None
            if depth is not None and int(depth.max()) > k:  # a proposer may not draft deeper than K
                draft = draft.subset(depth <= k)
            num_proposed = draft.num_nodes
            if draft.num_nodes:
                masks = [m for m in hook.prune(state=state, draft=draft) if m is not None]
                if masks:
                    keep = torch.stack([m.bool().cpu() for m in masks]).all(0)  # drafts live on the CPU
                    keep = _close_under_ancestors(keep, draft.parents)
                    if not bool(keep.all()):
                        draft = draft.subset(keep)
            draft = replace(draft, num_proposed=num_proposed)

            cache_start = target.cache_len
            verification = hook.verify(state=state, draft=draft, target=target)
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
            path_tokens = draft.tokens[accepted].tolist()
            emitted = path_tokens + [int(decision.next_token)]
            kinds = [ACCEPTED] * len(path_tokens) + [PLAIN if draft.num_nodes == 0 else decision.next_kind]
            rows = torch.cat([torch.zeros(1, dtype=torch.long), accepted + 1])  # row that predicted each token
            target_argmax = verification.target_argmax()
            row_probs = verification.logits.float().softmax(-1)
            target_tokens = target_argmax[rows].tolist()
            target_probs = row_probs[rows, torch.tensor(emitted)].tolist()
            if draft.num_nodes:
                parent_rows = torch.where(draft.parents < 0, 0, draft.parents + 1)
                node_probs = row_probs[parent_rows, draft.tokens]
            else:
                node_probs = torch.zeros(0)
            status = self._node_status(draft, decision)
            decision = replace(decision, node_status=status)

            target.commit(cache_start, draft.num_nodes, accepted)
            stop_reason = self._stop_reason(emitted, state, tokenizer, eos, stop)
            if stop_reason:
                emitted, kinds = self._truncate(emitted, kinds, state, eos, tokenizer, stop)
            new_tokens = torch.cat([state.tokens, torch.tensor(emitted, dtype=torch.long)])
            new_hidden = None
            if verification.hidden is not None:
                new_hidden = verification.hidden[rows]

            n_emit = len(emitted)
            stats.steps += 1
            stats.new_tokens += n_emit
            stats.draft_tokens += draft.num_nodes
            stats.proposed_tokens += num_proposed
            stats.accepted_tokens += min(len(path_tokens), n_emit)
            stats.hit_steps += n_emit > 1
            stats.k_sum += k
            if context.sampling.greedy:
                stats.differs_from_target += sum(int(e != t) for e, t in zip(emitted, target_tokens))

            record = StepRecord(
                step=state.step, k=k, draft=draft, num_proposed=num_proposed, decision=decision,
                emitted=tuple(emitted), emitted_kinds=tuple(kinds), target_tokens=tuple(target_tokens[:n_emit]),
                target_probs=tuple(target_probs[:n_emit]), node_target_argmax=target_argmax, verification=verification,
                node_target_probs=node_probs, forward_seconds=verification.forward_seconds,
                step_seconds=time.perf_counter() - t_step, stage_seconds=dict(self.timer.seconds),
                time_since_start=time.perf_counter() - t_start, state=state,
            )
            state = replace(
                state, tokens=new_tokens, step=state.step + 1, next_position=state.next_position + n_emit,
                last_k=k, last_accepted=len(path_tokens), last_proposed=draft.num_nodes, hidden=new_hidden,
            )
            keep_index = hook.window(state=state, cache_len=target.cache_len)
            if keep_index is not None:
                target.keep(keep_index)
            hook.on_step_end(record=record)
            records.append(record)
            self._partial = self._result(state, stats, records, t_start, tokenizer, stop)
            if on_step:
                on_step(record, emitted)

        stats.stop_reason = stop_reason
        return self._result(state, stats, records, t_start, tokenizer, stop)

    @staticmethod
    def _node_status(draft: Draft, decision: Decision) -> tuple[str, ...]:
        status = [REJECTED] * draft.num_nodes
        for i in decision.accepted.tolist():
            status[i] = ACCEPTED
        for i in decision.info.get("deduped_nodes", []):
            status[i] = DEDUPED
        return tuple(status)

    def _result(self, state, stats, records, t_start, tokenizer, stop) -> DecodeResult:
        stats.total_seconds = time.perf_counter() - t_start
        stats.decode_seconds = stats.total_seconds - stats.prefill_seconds
        for extra in self.hook.run_stats():
            stats.extras.update(extra or {})
        ids = state.generated.tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for s in stop:
            if s and s in text:
                text = text[: text.index(s)]
        return DecodeResult(text=text, token_ids=ids, stats=stats.as_dict(), steps=records)

    @staticmethod
    def _stop_reason(emitted, state, tokenizer, eos, stop) -> str:
        if any(t in eos for t in emitted):
            return "eos"
        if state.num_generated + len(emitted) >= state.max_new_tokens:
            return "max_new_tokens"
        if stop:
            tail = tokenizer.decode(state.tokens[-16:].tolist() + list(emitted), skip_special_tokens=True)
            if any(s and s in tail for s in stop):
                return "stop_string"
        return ""

    @staticmethod
    def _truncate(emitted, kinds, state, eos, tokenizer, stop):
        """Cut the emitted tokens at the first EOS (kept), the token budget, or the token ending a stop string."""
        out, out_kinds = [], []
        budget = state.max_new_tokens - state.num_generated
        prefix = state.tokens[-16:].tolist()
        for tok, kind in zip(emitted, kinds):
            if len(out) >= budget:
                break
            out.append(tok)
            out_kinds.append(kind)
            if tok in eos:
                break
            if stop and any(s and s in tokenizer.decode(prefix + out, skip_special_tokens=True) for s in stop):
                break
        return out, out_kinds
