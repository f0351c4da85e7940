"""Metrics computed from the trace store: per run (``run_metrics``) and aggregated per strategy in Prometheus
text format (``TraceCollector``), served by ``python -m mtpflow.traces serve`` and on the playground's
``/metrics`` (``exposition``).

Everything is read from the database at scrape time, so every process that records traces (CLI, benchmark,
playground) shows up in one exporter, and counters only grow as long as runs are not deleted.
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from mtpflow.traces.store import TraceStore

# Histogram buckets in seconds. TTFT spans a prefill (tens of ms on a GPU to seconds on a CPU); inter-token
# latency is one verify forward shared by the tokens it emitted.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
PREFIX = "mtpflow_spec_decode"


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def run_metrics(store: TraceStore, run_id: int) -> dict[str, Any]:
    """MAL, hit rate, average K, acceptance rate (overall and by draft depth), error propagation rate, TTFT and
    inter-token latency of one run, from its recorded steps and token events (also for unfinished runs)."""
    run = store.get_run(run_id)
    if run is None:
        raise KeyError(run_id)
    steps = store.steps(run_id)
    events = store.token_events(run_id)
    emitted = [e for e in events if e["emitted"]]
    n_steps = len(steps)
    new_tokens = len(emitted)
    drafted_at: dict[int, int] = {}  # depth -> steps that sent a node at this depth to the verify forward
    accepted_at: dict[int, int] = {}  # depth -> steps that accepted a node at this depth
    per_step_depths: dict[int, set] = {}
    for e in events:
        if e["depth"] is None or e["status"] == "pruned":
            continue
        per_step_depths.setdefault(e["step"], set())
        if e["depth"] not in per_step_depths[e["step"]]:
            per_step_depths[e["step"]].add(e["depth"])
            drafted_at[e["depth"]] = drafted_at.get(e["depth"], 0) + 1
        if e["status"] == "accepted":
            accepted_at[e["depth"]] = accepted_at.get(e["depth"], 0) + 1
    judged = [e for e in emitted if e["matches_target"] is not None]
    stats = run.get("stats") or {}
    ttft = stats.get("time_to_first_token")
    gaps = []  # per emitted token: the time since the previous step ended, shared by the tokens of a step
    prev = ttft
    for s in steps:
        if prev is not None and s["num_emitted"]:
            gaps += [(s["time_since_start"] - prev) / s["num_emitted"]] * s["num_emitted"]
        prev = s["time_since_start"]
    gaps.sort()
    draft_tokens = sum(s["num_kept"] for s in steps)
    accepted = sum(s["accepted_length"] for s in steps)
    return {
        "run_id": run_id,
        "strategy": run["strategy"],
        "status": run["status"],
        "new_tokens": new_tokens,
        "verify_forwards": n_steps,
        # the first token comes from the prefill, as in RunStats
        "mal": round(_ratio(new_tokens - 1, n_steps), 4) if n_steps else 0.0,
        "mtp_hit_rate": round(_ratio(sum(s["num_emitted"] > 1 for s in steps), n_steps), 4),
        "mtp_avg_k_used": round(_ratio(sum(s["k"] for s in steps), n_steps), 4),
        "proposed_tokens": sum(s["num_proposed"] for s in steps),
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": round(_ratio(accepted, draft_tokens), 4),
        "acceptance_by_position": {d: round(_ratio(accepted_at.get(d, 0), drafted_at[d]), 4)
                                   for d in sorted(drafted_at)},
        "mtp_error_propagation_rate": (round(_ratio(sum(not e["matches_target"] for e in judged), len(judged)), 4)
                                       if judged else None),
        "time_to_first_token": ttft,
        "inter_token_latency_mean": round(sum(gaps) / len(gaps), 5) if gaps else None,
        "inter_token_latency_p50": round(gaps[len(gaps) // 2], 5) if gaps else None,
        "inter_token_latency_p90": round(gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))], 5) if gaps else None,
        "tokens_per_second": stats.get("tokens_per_second"),
        "status_counts": _count(e["status"] for e in events),
    }


def _count(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _histogram(name: str, doc: str, buckets: tuple[float, ...], rows) -> HistogramMetricFamily:
    """rows: (strategy, value, weight). Cumulative buckets per strategy."""
    by_strategy: dict[str, list] = {}
    for strategy, value, weight in rows:
        if value is None or weight is None or (isinstance(value, float) and math.isnan(value)):
            continue
        by_strategy.setdefault(strategy, []).append((float(value), int(weight)))
    h = HistogramMetricFamily(name, doc, labels=["strategy"])
    for strategy, obs in sorted(by_strategy.items()):
        cumulative = [(str(b), sum(w for v, w in obs if v <= b)) for b in buckets]
        cumulative.append(("+Inf", sum(w for _, w in obs)))
        h.add_metric([strategy], cumulative, sum_value=sum(v * w for v, w in obs))
    return h


class TraceCollector(Collector):
    """Prometheus metrics aggregated per strategy over every run in the trace database."""

    def __init__(self, store: TraceStore):
        self.store = store

    def _query(self, sql: str) -> list[tuple]:
        with self.store.engine.connect() as conn:
            return [tuple(r) for r in conn.exec_driver_sql(sql).all()]

    def collect(self):
        q = self._query
        steps = q("""SELECT r.strategy, count(s.id), sum(s.num_kept > 0), sum(s.num_kept), sum(s.num_proposed),
                            sum(s.accepted_length), sum(s.num_emitted), sum(s.num_emitted > 1), sum(s.k)
                     FROM steps s JOIN runs r ON r.id = s.run_id GROUP BY r.strategy""")
        counters = [
            ("num_steps", "Verify forwards (decoding steps).", 1),
            ("num_drafts", "Steps that sent at least one draft token to the verify forward.", 2),
            ("num_draft_tokens", "Draft tokens sent to the verify forward (after pruning).", 3),
            ("num_proposed_tokens", "Draft tokens proposed (before pruning).", 4),
            ("num_accepted_tokens", "Draft tokens accepted by the gate.", 5),
            ("num_emitted_tokens", "Tokens committed by decoding steps (accepted + recovered/bonus/plain).", 6),
            ("num_hit_steps", "Steps that emitted more than one token.", 7),
            ("k_used", "Sum of the K chosen per step (divide by num_steps for the average K).", 8),
        ]
        for name, doc, col in counters:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["strategy"])
            for row in steps:
                c.add_metric([row[0]], float(row[col] or 0))
            yield c

        per_pos = q("""SELECT r.strategy, e.depth, count(DISTINCT e.step || ':' || e.run_id),
                              sum(e.status = 'accepted')
                       FROM token_events e JOIN runs r ON r.id = e.run_id
                       WHERE e.depth IS NOT NULL AND e.status != 'pruned'
                       GROUP BY r.strategy, e.depth""")
        drafted = CounterMetricFamily(f"{PREFIX}_num_draft_tokens_per_pos",
                                      "Steps that drafted a token at this draft position (depth, 1-based).",
                                      labels=["strategy", "position"])
        accepted = CounterMetricFamily(f"{PREFIX}_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted at this draft position (depth, 1-based).",
                                       labels=["strategy", "position"])
        rate = GaugeMetricFamily("mtpflow_acceptance_rate_by_position",
                                 "Accepted / drafted at each draft position, over all recorded runs.",
                                 labels=["strategy", "position"])
        for strategy, depth, n_drafted, n_accepted in per_pos:
            drafted.add_metric([strategy, str(depth)], float(n_drafted))
            accepted.add_metric([strategy, str(depth)], float(n_accepted or 0))
            rate.add_metric([strategy, str(depth)], _ratio(n_accepted or 0, n_drafted))
        yield drafted
        yield accepted
        yield rate

        errors = q("""SELECT r.strategy, count(e.id), sum(NOT e.matches_target)
                      FROM token_events e JOIN runs r ON r.id = e.run_id
                      WHERE e.emitted AND e.matches_target IS NOT NULL GROUP BY r.strategy""")
        judged = CounterMetricFamily(f"{PREFIX}_num_judged_tokens",
                                     "Emitted tokens of greedy runs (compared with the target's own choice).",
                                     labels=["strategy"])
        differ = CounterMetricFamily(f"{PREFIX}_num_error_tokens",
                                     "Emitted tokens of greedy runs that differ from the target's own choice.",
                                     labels=["strategy"])
        # every strategy gets both series (0 when nothing was judged), so the alert's ratio always exists
        by_strategy = {row[0]: (0, 0) for row in steps}
        by_strategy.update({strategy: (n, bad or 0) for strategy, n, bad in errors})
        for strategy, (n, bad) in sorted(by_strategy.items()):
            judged.add_metric([strategy], float(n))
            differ.add_metric([strategy], float(bad))
        yield judged
        yield differ

        hit = GaugeMetricFamily("mtp_hit_rate", "Share of steps that emitted more than one token.", labels=["strategy"])
        avg_k = GaugeMetricFamily("mtp_avg_k_used", "Average K chosen per step.", labels=["strategy"])
        mal = GaugeMetricFamily("mtpflow_mean_accepted_length",
                                "MAL: tokens emitted per verify forward, bonus included.", labels=["strategy"])
        acc = GaugeMetricFamily("mtpflow_spec_decode_acceptance_rate", "Accepted / drafted tokens.",
                                labels=["strategy"])
        for row in steps:
            hit.add_metric([row[0]], _ratio(row[7] or 0, row[1]))
            avg_k.add_metric([row[0]], _ratio(row[8] or 0, row[1]))
            mal.add_metric([row[0]], _ratio(row[6] or 0, row[1]))
            acc.add_metric([row[0]], _ratio(row[5] or 0, row[3] or 0))
        err = GaugeMetricFamily("mtp_error_propagation_rate",
                                "Share of emitted tokens (greedy runs) that differ from the target's own choice.",
                                labels=["strategy"])
        for strategy, n, bad in errors:
            err.add_metric([strategy], _ratio(bad or 0, n))
        yield from (hit, avg_k, mal, acc, err)

        runs = q("SELECT strategy, status, count(*) FROM runs GROUP BY strategy, status")
        c = CounterMetricFamily("mtpflow_runs", "Recorded runs by final status (running = in progress or killed).",
                                labels=["strategy", "status"])
        for strategy, status, n in runs:
            c.add_metric([strategy, status], float(n))
        yield c

        configured = GaugeMetricFamily("mtpflow_configured_k", "K configured for the strategy's latest run.",
                                       labels=["strategy"])
        for strategy, config in q("""SELECT strategy, config FROM runs WHERE id IN
                                       (SELECT max(id) FROM runs GROUP BY strategy)"""):
            k = _configured_k(config)
            if k is not None:
                configured.add_metric([strategy], float(k))
        yield configured

        yield _histogram("mtpflow_time_to_first_token_seconds", "Time from run start to the first token.",
                         TTFT_BUCKETS,
                         q("""SELECT strategy, json_extract(stats, '$.time_to_first_token'), 1 FROM runs
                              WHERE stats IS NOT NULL AND json_valid(stats)"""))
        # per emitted token: the gap since the previous step (or the first token) over the tokens it emitted
        yield _histogram("mtpflow_inter_token_latency_seconds", "Time between output tokens.", LATENCY_BUCKETS,
                         q("""SELECT r.strategy,
                                     (s.time_since_start - coalesce(lag(s.time_since_start) OVER w,
                                        json_extract(r.stats, '$.time_to_first_token'))) / s.num_emitted,
                                     s.num_emitted
                              FROM steps s JOIN runs r ON r.id = s.run_id
                              WHERE s.num_emitted > 0
                              WINDOW w AS (PARTITION BY s.run_id ORDER BY s.step)"""))
        yield _histogram("mtpflow_verify_forward_seconds", "Duration of one verify forward.", LATENCY_BUCKETS,
                         q("""SELECT r.strategy, s.forward_seconds, 1 FROM steps s JOIN runs r ON r.id = s.run_id"""))
        yield _histogram("mtpflow_step_seconds", "Duration of one decoding step (all stages).", LATENCY_BUCKETS,
                         q("""SELECT r.strategy, s.step_seconds, 1 FROM steps s JOIN runs r ON r.id = s.run_id"""))


def _configured_k(config_json: str | None) -> int | None:
    try:
        cfg = json.loads(config_json or "{}")
    except ValueError:
        return None
    if cfg.get("k") is not None:
        return int(cfg["k"])
    select_k = (cfg.get("strategy") or {}).get("select_k") or {}
    for key in ("k", "max_k"):
        if isinstance(select_k.get(key), int):
            return int(select_k[key])
    return None


def metrics_registry(store: TraceStore) -> CollectorRegistry:
    """A registry holding only the trace metrics (not the process-global default registry)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TraceCollector(store))
    return registry


def exposition(store: TraceStore) -> bytes:
    """The metrics in Prometheus text format."""
    return generate_latest(metrics_registry(store))


def serve(store: TraceStore, port: int, host: str = "127.0.0.1"):
    """Start the exporter's HTTP server (in a daemon thread) and return it."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics_registry(store))
    return server
