"""The server's Prometheus metrics (``GET /metrics``): running and waiting requests, batch size per step, time
to first token, inter-token and end-to-end latency, requests by outcome, plus the trace metrics computed from
the trace store (``mtpflow.traces.metrics``).

The server counters live in this process's memory, so they count every request even when trace retention
has deleted its run or sampling skipped its token events; the trace metrics cover the runs still stored.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mtpflow.traces.metrics import LATENCY_BUCKETS, TTFT_BUCKETS

PREFIX = "mtpflow_server"
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """One registry per app (never the process-global one), so tests can run several servers in a process."""

    def __init__(self, engine, store=None):
        r = self.registry = CollectorRegistry(auto_describe=True)
        if store is not None:
            from mtpflow.traces.metrics import TraceCollector

            r.register(TraceCollector(store))
        # multiprocess_mode: one series per live replica process on Ray Serve (mtpflow.serve.ray_app), where
        # prometheus_client shares files between processes and these two are set, not read through a function
        self.running = Gauge(f"{PREFIX}_requests_running", "Requests decoding in the running batch.", registry=r,
                             multiprocess_mode="liveall")
        self.running.set_function(lambda: float(engine.num_running))
        self.waiting = Gauge(f"{PREFIX}_requests_waiting", "Requests in the engine's waiting queue.", registry=r,
                             multiprocess_mode="liveall")
        self.waiting.set_function(lambda: float(engine.num_waiting))
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests to the completion endpoints by outcome: "
                                "complete, interrupted (client left or shutdown), failed, rejected (4xx), "
                                "queue_full and queue_timeout (429), timeout (408), unavailable (503), "
                                "unauthorized (401).",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated (all requests).",
                                         registry=r)
        self.steps = Counter(f"{PREFIX}_engine_steps", "Batched decoding steps of the engine.", registry=r)
        self.batch_size = Histogram(f"{PREFIX}_batch_size", "Sequences in the batch at each engine step.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request arrival to its first token.",
                              ["strategy"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between output tokens of a request "
                             "(a step that commits several tokens shares its time among them).", ["strategy"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request arrival to its last token.",
                             ["strategy"], buckets=E2E_BUCKETS, registry=r)
        add = getattr(engine, "add_step_listener", None)
        if add is not None:
            add(self.on_step)

    def on_step(self, batch_size: int, new_tokens: int) -> None:
        """Engine step listener (called from the engine's thread; prometheus_client is thread-safe)."""
        self.steps.inc()
        self.batch_size.observe(batch_size)

    def observe_request(self, strategy: str, arrival: float, first_token: float | None, last_token: float | None,
                        end: float, completion_tokens: int) -> None:
        """Latencies of one finished request. Inter-token latency: the request's tokens after the first share
        the time from its first to its last token (steps commit several tokens at once, so the gap between
        two stream pieces is not the gap between two tokens)."""
        if first_token is not None:
            self.ttft.labels(strategy).observe(first_token - arrival)
            if last_token is not None and completion_tokens > 1:
                gap = (last_token - first_token) / (completion_tokens - 1)
                itl = self.itl.labels(strategy)
                for _ in range(completion_tokens - 1):
                    itl.observe(gap)
        self.e2e.labels(strategy).observe(end - arrival)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ServerMetrics"]
