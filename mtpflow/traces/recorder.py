"""``TraceRecorder``: a run plugin that writes every step's accept/reject decisions to the trace store.

It listens on on_run_start / on_step_end / on_run_end, plus a pluggy wrapper around ``prune`` to see the
nodes the pruners dropped (the step record only holds the kept ones). Rows are buffered in memory and
written in one transaction every ``flush_seconds``, and at the end of the run whatever its status. A run that
failed on an internal error keeps its traceback (the run's ``error_traceback`` column) and its one-line error
(``stats["error"]``).

``trace.sample`` is the share of runs whose per-token events are written (chosen from the run id, so the same
runs are sampled on every replay of a database); run rows and steps, which the metrics are computed from,
are always written. ``trace.retention`` caps the database (``mtpflow.traces.retention``).
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from mtpflow.errors import check_range
from mtpflow.plugins import hookimpl
from mtpflow.traces.store import RUNNING, TraceStore
from mtpflow.types import ACCEPTED, BONUS, PLAIN, PRUNED, REJECTED, DecodeResult, StepRecord

GATED = "gated"  # a draft token the target would have chosen, on an accepted prefix, that the gate refused
STATUS_STAGE = {ACCEPTED: "gate", REJECTED: "gate", GATED: "gate", "deduped": "dedup", PRUNED: "prune"}


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("mtpflow")
    except Exception:  # a source checkout without metadata
        return "unknown"


def _floats(t: torch.Tensor | None) -> list[float | None] | None:
    return None if t is None else [float(x) for x in t.detach().float().cpu().tolist()]


def events_sampled(run_id: int, rate: float) -> bool:
    """Whether run ``run_id`` keeps its token events at sampling ``rate``: Fibonacci hashing of the id spreads
    consecutive runs evenly, so any window of runs holds close to ``rate`` of them."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    return ((int(run_id) * 0x9E3779B1) & 0xFFFFFFFF) / 2.0 ** 32 < rate


def _close_under_ancestors(keep: list[bool], parents: list[int]) -> list[bool]:
    keep = list(keep)
    for i, p in enumerate(parents):
        if p >= 0 and not keep[p]:
            keep[i] = False
    return keep


class TraceRecorder:
    """Records one run (a new recorder per run, sharing the store)."""

    def __init__(self, store: TraceStore, flush_seconds: float = 1.0, sample: float = 1.0, retention=None):
        self.store = store
        self.flush_seconds = float(flush_seconds)
        self.sample = float(sample)
        self.retention = retention  # a TraceRetention told when the run's rows are written, or None
        self.run_id: int | None = None
        self.disabled = False
        self.sampled = True  # this run's token events are recorded (decided at run start from trace.sample)
        self._steps: list[dict] = []
        self._events: list[dict] = []
        self._last_flush = 0.0
        self._pre_prune: tuple[Any, list[bool]] | None = None  # (draft before pruning, final keep mask)
        self._tokenizer = None
        self._first_token_recorded = False
        self._texts: dict[int, str] = {}

    # ----- hooks -----------------------------------------------------------------------------------------
    @hookimpl
    def on_run_start(self, context) -> dict | None:
        self._tokenizer = context.tokenizer
        try:
            self.run_id = self.store.start_run(
                strategy=context.strategy, config=context.config, model_id=context.model_id,
                prompt=context.prompt, prompt_tokens=int(context.prompt_tokens.numel()),
                package_version=_package_version())
        except Exception as exc:  # never let tracing break a decode
            self._give_up(exc)
            return None
        self._last_flush = time.perf_counter()
        self.sampled = events_sampled(self.run_id, self.sample)
        return {"trace_run_id": self.run_id}

    @hookimpl(wrapper=True)
    def prune(self, state, draft):
        masks = yield
        if not self.disabled and self.sampled:
            n = draft.num_nodes
            keep = [True] * n
            for m in masks or ():
                if m is not None:
                    keep = [a and bool(b) for a, b in zip(keep, m.tolist())]
            self._pre_prune = (draft, _close_under_ancestors(keep, draft.parents.tolist()))
        return masks

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        if self.disabled or self.run_id is None:
            return
        pre_prune, self._pre_prune = self._pre_prune, None
        if not self._first_token_recorded and self.sampled:
            state = record.state
            self._first_token(int(state.tokens[state.prompt_len]))
        self._record_step(record, pre_prune)
        if time.perf_counter() - self._last_flush >= self.flush_seconds:
            self._flush()

    @hookimpl
    def on_run_end(self, result: DecodeResult, status: str) -> None:
        if self.run_id is not None:
            result.run_id = self.run_id  # also when recording stopped: the run row exists
        if self.disabled or self.run_id is None:
            return
        if not self._first_token_recorded and result.token_ids and self.sampled:
            self._first_token(int(result.token_ids[0]))
        try:
            self._fill_texts(self._events)
            stats = dict(result.stats)
            # a failed run's traceback (put there by the engine; its one line stays in the stats as "error")
            error_traceback = stats.pop("error_traceback", None)
            if not self.sampled:
                stats["trace_events_sampled"] = False  # tells the viewers why a run has steps but no tokens
            self.store.finish_run(self.run_id, status, output_text=result.text, stats=stats,
                                  steps=self._steps, events=self._events, error_traceback=error_traceback)
        except Exception as exc:
            self._give_up(exc)
        self._steps, self._events = [], []
        if self.retention is not None:
            self.retention.run_finished()

    # ----- building rows -----------------------------------------------------------------------------------
    def _first_token(self, token: int) -> None:
        """The token the prefill produced (before step 0)."""
        self._first_token_recorded = True
        self._events.append(dict(
            run_id=self.run_id, step=-1, position=0, node=None, depth=None, token_id=token, status=PLAIN,
            emitted=True, decided_by="prefill", draft_prob=None, target_prob=None, pfs=None, gate_score=None,
            matches_target=None))

    def _record_step(self, r: StepRecord, pre_prune) -> None:
        run_id, step = self.run_id, r.step
        draft, decision = r.draft, r.decision
        n_kept = draft.num_nodes
        base = r.state.num_generated  # output index of the first token this step emits
        path = decision.accepted.tolist()
        n_emit = len(r.emitted)
        bonus = BONUS in r.emitted_kinds
        greedy = r.state.sampling.greedy
        self._steps.append(dict(
            run_id=run_id, step=step, k=r.k, num_proposed=r.num_proposed, num_kept=n_kept,
            accepted_length=len(path), num_emitted=n_emit, bonus=bonus, forward_seconds=r.forward_seconds,
            step_seconds=r.step_seconds, time_since_start=r.time_since_start,
            stage_seconds=json.dumps({k: round(v, 6) for k, v in r.stage_seconds.items()})))
        if not self.sampled:
            return
        events = self._events

        # original (pre-pruning) node index of each kept node, and the pruned nodes themselves
        original_index = list(range(n_kept))
        if pre_prune is not None and pre_prune[0].num_nodes == r.num_proposed and r.num_proposed > n_kept:
            full, keep = pre_prune
            original_index = [i for i, k in enumerate(keep) if k]
            depths = full.depths().tolist()
            probs, pfs = _floats(full.probs), _floats(full.scores.get("pfs"))
            tokens = full.tokens.tolist()
            for i, k in enumerate(keep):
                if not k:
                    events.append(dict(
                        run_id=run_id, step=step, position=base + depths[i] - 1, node=i, depth=depths[i],
                        token_id=tokens[i], status=PRUNED, emitted=False, decided_by="prune",
                        draft_prob=probs and probs[i], target_prob=None, pfs=pfs and pfs[i], gate_score=None,
                        matches_target=None))

        if n_kept:
            tokens = draft.tokens.tolist()
            parents = draft.parents.tolist()
            depths = draft.depths().tolist()
            probs, pfs = _floats(draft.probs), _floats(draft.scores.get("pfs"))
            gate_scores = _floats(decision.gate_scores)
            target_probs = _floats(r.node_target_probs)
            argmax = r.node_target_argmax.tolist()
            status = list(decision.node_status) or [REJECTED] * n_kept
            on_path = set(path)
            path_rank = {node: j for j, node in enumerate(path)}
            for i in range(n_kept):
                # the target's greedy choice only defines "matches" when decoding is greedy
                matches = tokens[i] == argmax[parents[i] + 1] if greedy else None  # row p + 1 is node p
                s = status[i]
                if s == REJECTED and matches and (parents[i] < 0 or parents[i] in on_path):
                    s = GATED
                events.append(dict(
                    run_id=run_id, step=step, position=base + depths[i] - 1, node=original_index[i],
                    depth=depths[i], token_id=tokens[i], status=s,
                    emitted=i in path_rank and path_rank[i] < n_emit, decided_by=STATUS_STAGE.get(s, "gate"),
                    draft_prob=probs and probs[i], target_prob=target_probs and target_probs[i],
                    pfs=pfs and pfs[i], gate_score=gate_scores and gate_scores[i], matches_target=matches))

        if n_emit > len(path):  # the recovered / bonus / plain token after the accepted path
            j = len(path)
            token = r.emitted[j]
            events.append(dict(
                run_id=run_id, step=step, position=base + j, node=None, depth=None, token_id=token,
                status=r.emitted_kinds[j], emitted=True, decided_by=decision.decided_by,
                draft_prob=None, target_prob=r.target_probs[j] if j < len(r.target_probs) else None, pfs=None,
                gate_score=None,
                matches_target=token == r.target_tokens[j] if greedy and j < len(r.target_tokens) else None))

    # ----- writing -----------------------------------------------------------------------------------------
    def _fill_texts(self, events: list[dict]) -> None:
        """Decode each distinct token id once per run (batched), not once per event."""
        missing = sorted({e["token_id"] for e in events} - self._texts.keys())
        if missing and self._tokenizer is not None:
            texts = self._tokenizer.batch_decode([[t] for t in missing], skip_special_tokens=False)
            self._texts.update(zip(missing, texts))
        for e in events:
            e["token_text"] = self._texts.get(e["token_id"], "")

    def _flush(self) -> None:
        try:
            self._fill_texts(self._events)
            self.store.write_batch(self._steps, self._events)
        except Exception as exc:
            self._give_up(exc)
        self._steps, self._events = [], []
        self._last_flush = time.perf_counter()

    def _give_up(self, exc: BaseException) -> None:
        """Stop recording this run after one warning line; what was written stays."""
        self.disabled = True
        msg = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        print(f"mtpflow: warning: trace recording stopped ({type(exc).__name__}: {msg[0] if msg else ''}); "
              f"the decode continues", file=sys.stderr)


def recorder_factory(store: TraceStore, flush_seconds: float = 1.0, sample: float = 1.0, retention=None):
    """A run-plugin factory ``f(pipeline) -> TraceRecorder`` sharing one store (see ``default_run_plugins``)."""
    sample = float(check_range("trace.sample", sample, 0, 1))

    def make(_pipeline=None) -> TraceRecorder:
        return TraceRecorder(store, flush_seconds=flush_seconds, sample=sample, retention=retention)

    make.store = store  # lets the playground and the benchmark find the database
    make.retention = retention  # the server runs it in a thread (TraceRetention.start)
    return make


def recorder_from_config(trace_cfg, store: TraceStore | None = None):
    """The recorder factory for a ``trace`` config node (db, flush_seconds, busy_timeout_seconds, sample,
    retention); ``store`` reuses one already open. Bad values are one ConfigError line."""
    from mtpflow.traces.retention import retention_from_config

    if store is None:
        store = TraceStore(trace_cfg.get("db"), busy_timeout_seconds=float(trace_cfg.get("busy_timeout_seconds", 30.0)))
    sample = trace_cfg.get("sample", 1.0)
    return recorder_factory(store, flush_seconds=float(trace_cfg.get("flush_seconds", 1.0)),
                            sample=1.0 if sample is None else sample,
                            retention=retention_from_config(store, trace_cfg))


__all__ = ["TraceRecorder", "recorder_factory", "recorder_from_config", "events_sampled", "GATED", "RUNNING"]
