"""Many engine replicas behind one OpenAI-compatible endpoint, on Ray Serve: ``python -m mtpflow.serve --ray
--replicas N`` (or ``serve run mtpflow.serve.ray_app:build replicas=N``). Ray Serve routes the requests, checks
each replica's health, restarts a replica that died and autoscales on ongoing requests; a replica is one engine
(one model load) behind the same FastAPI app as ``python -m mtpflow.serve`` (docs/server.md, "Many replicas on
Ray Serve").

Each replica records into its own trace database (``traces.replica-<rank>.db`` beside ``trace.db``): SQLite takes
one writer at a time, so N engines flushing every second into one file would queue on its lock, and N retention
threads would each enforce the caps over every replica's runs. ``/metrics`` shows every replica on the node that
answers: the server metrics through prometheus_client's multiprocess directory (counters and histograms
summed over the replicas, gauges per process), the trace metrics of every replica database with a ``replica``
label.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ray import serve

APP_NAME = "mtpflow"
DEPLOYMENT_NAME = "mtpflow"
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode, read when it is imported
OBJECT_STORE_BYTES = 128 << 20  # replicas pass requests and responses, never tensors, through the object store


# ----- settings -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scaling:
    """A fixed number of replicas, or autoscaling between ``min_replicas`` and ``max_replicas`` on the requests
    in flight per replica (running plus queued: Serve's ``target_ongoing_requests``)."""

    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None

    def __post_init__(self):
        from mtpflow.errors import UserError

        autoscaled = self.min_replicas is not None or self.max_replicas is not None
        if self.replicas is not None and autoscaled:
            raise UserError("--replicas fixes the number of replicas; leave out --min-replicas/--max-replicas, or "
                            "give those alone to autoscale")
        if self.replicas is not None and self.replicas < 1:
            raise UserError(f"--replicas must be >= 1, got {self.replicas}")
        if autoscaled:
            low, high = self.low, self.high
            if low < 0 or high < 1 or low > high:
                raise UserError(f"autoscaling needs 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, "
                                f"got {low} and {high}")
        if self.target_ongoing_requests is not None:
            if not autoscaled:
                raise UserError("--target-ongoing-requests steers autoscaling: give it with --min-replicas and/or "
                                "--max-replicas")
            if not self.target_ongoing_requests > 0:
                raise UserError(f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}")

    @property
    def autoscaled(self) -> bool:
        return self.replicas is None and (self.min_replicas is not None or self.max_replicas is not None)

    @property
    def low(self) -> int:
        return self.replicas or (1 if self.min_replicas is None else self.min_replicas)

    @property
    def high(self) -> int:
        if self.replicas is not None:
            return self.replicas
        return self.max_replicas if self.max_replicas is not None else max(1, self.low)

    def describe(self) -> str:
        if not self.autoscaled:
            return f"{self.low} replica{'s' if self.low != 1 else ''}"
        return f"{self.low} to {self.high} replicas (autoscaled)"


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica is built from: the server's Hydra overrides and options (the deployment's argument)."""

    overrides: tuple[str, ...] = ()
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)  # never in a log line
    metrics_dir: str | None = None  # prometheus_client's multiprocess directory (one node)
    threads: int = 1  # torch threads per replica (its CPUs)


def deployment_options(scaling: Scaling, *, max_batch_size: int, max_waiting: int, replica_cpus: float,
                       drain_timeout: float, metrics_dir: str | None) -> dict:
    """``Deployment.options`` for the engine replicas.

    A replica takes up to ``max_batch_size`` requests at a time (one running batch); Serve queues the rest, at
    most ``max_waiting`` (503 past that), and autoscales when the requests in flight per replica pass
    ``target_ongoing_requests`` (default: one full batch)."""
    options: dict = {
        "max_ongoing_requests": max_batch_size,
        "max_queued_requests": max_waiting,
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": float(drain_timeout),
        "ray_actor_options": {"num_cpus": replica_cpus},
    }
    if metrics_dir:
        options["ray_actor_options"]["runtime_env"] = {"env_vars": {METRICS_DIR_ENV: metrics_dir}}
    if scaling.autoscaled:
        options["autoscaling_config"] = {
            "min_replicas": scaling.low, "max_replicas": scaling.high, "initial_replicas": max(1, scaling.low),
            "target_ongoing_requests": scaling.target_ongoing_requests or max_batch_size,
        }
    else:
        options["num_replicas"] = scaling.low
    return options


def replica_trace_db(base: str | os.PathLike, rank: int | str) -> Path:
    """``traces.db`` -> ``traces.replica-<rank>.db`` in the same folder. Serve reuses a dead replica's rank for
    the replica that replaces it, so the files stay as many as the most replicas ever run at once."""
    base = Path(os.path.expanduser(str(base)))
    return base.with_name(f"{base.stem}.replica-{rank}{base.suffix or '.db'}")


def replica_trace_dbs(base: str | os.PathLike) -> dict[str, Path]:
    """Every replica database beside ``base``: {rank: path}."""
    base = Path(os.path.expanduser(str(base)))
    pattern = re.compile(re.escape(base.stem) + r"\.replica-(.+)" + re.escape(base.suffix or ".db") + "$")
    found = {}
    if base.parent.is_dir():
        for path in sorted(base.parent.iterdir()):
            m = pattern.match(path.name)
            if m:
                found[m.group(1)] = path
    return found


def _hydra_quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# ----- metrics of every replica ---------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ReplicaSetMetrics:
    """``/metrics`` of a replica: every replica's server metrics from the shared multiprocess directory, and every
    replica database's trace metrics with a ``replica`` label. Both are files on this node, so a multi-node
    cluster shows the replicas of the node whose replica answered."""

    def __init__(self, metrics_dir: str, trace_base: Path | None):
        self.metrics_dir, self.trace_base = metrics_dir, trace_base
        self._stores: dict[Path, object] = {}
        self._lock = threading.Lock()

    def forget_dead_processes(self) -> None:
        """Drop the live-only gauges (running, waiting, replica info) of replica processes that are gone, as
        prometheus_client's ``mark_process_dead`` expects a process manager to do; their counters and histograms
        stay in the sums (a counter never goes back)."""
        from prometheus_client import multiprocess

        pids = set()
        for name in os.listdir(self.metrics_dir):
            m = re.match(r"gauge_live\w*?_(\d+)\.db$", name)
            if m:
                pids.add(int(m.group(1)))
        for pid in pids:
            if not _pid_alive(pid):
                try:
                    multiprocess.mark_process_dead(pid, self.metrics_dir)
                except FileNotFoundError:  # another replica's scrape removed it first
                    pass

    def _trace_stores(self) -> list[tuple[str, object]]:
        from mtpflow.traces.store import TraceStore

        if self.trace_base is None:
            return []
        out = []
        with self._lock:
            for rank, path in replica_trace_dbs(self.trace_base).items():
                store = self._stores.get(path)
                if store is None:
                    try:
                        store = self._stores[path] = TraceStore(path)
                    except Exception:  # a database being created this instant: next scrape
                        continue
                out.append((rank, store))
        return out

    def collect_traces(self):
        """The trace metrics of every replica database, merged family by family with a ``replica`` label."""
        from prometheus_client.metrics_core import Metric

        from mtpflow.traces.metrics import TraceCollector

        families: dict[str, Metric] = {}
        for rank, store in self._trace_stores():
            for family in TraceCollector(store).collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for s in family.samples:
                    merged.add_sample(s.name, {"replica": rank, **s.labels}, s.value, s.timestamp, s.exemplar)
        return list(families.values())

    def exposition(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        self.forget_dead_processes()
        collector = self

        class Traces:
            def collect(self):
                return collector.collect_traces()

        for attempt in range(3):
            registry = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(registry, path=self.metrics_dir)
            registry.register(Traces())
            try:
                return generate_latest(registry)
            except FileNotFoundError:  # a dead process's file removed mid-read
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


def record_replica_info(rank: str, replica_id: str):
    """``mtpflow_server_replica_info{replica, replica_id, pid} 1`` while this process lives (multiprocess mode)."""
    from prometheus_client import Gauge

    info = Gauge("mtpflow_server_replica_info", "One series per live replica process (value 1): its rank (the "
                 "replica label of the trace metrics), Serve's replica id and its pid.", ["replica", "replica_id"],
                 registry=None, multiprocess_mode="liveall")
    info.labels(rank, replica_id).set(1)
    return info


# ----- the replica ----------------------------------------------------------------------------------------------------
def replica_rank(context) -> str:
    """The replica's rank (0..N-1, reused by the replica that replaces a dead one), else its unique id."""
    rank = getattr(context, "rank", None)
    rank = getattr(rank, "rank", rank)
    return str(rank) if isinstance(rank, int) else str(context.replica_tag)


@serve.ingress()  # the app is built per replica, over its own engine (__serve_build_asgi_app__)
class EngineReplica:
    """One replica: loads the model once, builds ``python -m mtpflow.serve``'s app over its engine."""

    def __init__(self, settings: ReplicaSettings):
        import torch

        from mtpflow.config import compose
        from mtpflow.serve.build import build_app, serving_overrides
        from mtpflow.traces.store import default_db_path

        torch.set_num_threads(max(1, int(settings.threads)))
        context = serve.get_replica_context()
        self.mtpflow_rank, self.mtpflow_replica_id = replica_rank(context), str(context.replica_tag)
        overrides = list(settings.overrides)
        cfg = compose(serving_overrides(overrides))
        trace_base = None
        if cfg.get("trace") is not None and cfg.trace.get("enabled", False):
            trace_base = Path(os.path.expanduser(str(cfg.trace.get("db") or default_db_path())))
            db = replica_trace_db(trace_base, self.mtpflow_rank)
            overrides.append(f"trace.db={_hydra_quoted(str(db))}")
        if settings.metrics_dir:
            os.makedirs(settings.metrics_dir, exist_ok=True)  # a replica on another node
        args = argparse.Namespace(overrides=overrides, served_model_name=settings.served_model_name,
                                  api_key=settings.api_key)
        # attribute names of our own: Serve's ASGI wrapper (a base class) has ``app`` and ``_asgi_app``
        self.mtpflow_app, _ = build_app(args)
        self.mtpflow_state = self.mtpflow_app.state.mtpflow
        self.mtpflow_engine = self.mtpflow_state.engine
        if os.environ.get(METRICS_DIR_ENV) and settings.metrics_dir:
            self._start_multiprocess_metrics(settings.metrics_dir, trace_base)

    def _start_multiprocess_metrics(self, metrics_dir: str, trace_base: Path | None) -> None:
        record_replica_info(self.mtpflow_rank, self.mtpflow_replica_id)
        # The app's /metrics calls state.metrics.exposition(): every replica's metrics instead of this one's.
        self.mtpflow_state.metrics.exposition = ReplicaSetMetrics(metrics_dir, trace_base).exposition
        metrics, engine, state = self.mtpflow_state.metrics, self.mtpflow_engine, self.mtpflow_state

        def refresh_gauges():
            # multiprocess gauges hold what was last set (a function gauge is not written to the shared files)
            while not state.shut_down:
                metrics.running.set(engine.num_running)
                metrics.waiting.set(engine.num_waiting)
                time.sleep(0.5)

        threading.Thread(target=refresh_gauges, name="mtpflow-replica-gauges", daemon=True).start()

    def __serve_build_asgi_app__(self):
        return self.mtpflow_app

    def check_health(self):
        """Serve calls this every ``health_check_period_s``; raising marks the replica unhealthy, and Serve
        replaces it."""
        if not self.mtpflow_engine.healthy():
            raise RuntimeError("the engine's decoding thread died")


EngineDeployment = serve.deployment(name=DEPLOYMENT_NAME)(EngineReplica)


def application(scaling: Scaling, settings: ReplicaSettings, *, max_batch_size: int, max_waiting: int,
                replica_cpus: float = 1.0, drain_timeout: float = 30.0):
    """The bound Serve application (``serve.run`` it, or return it from a ``serve run`` builder)."""
    options = deployment_options(scaling, max_batch_size=max_batch_size, max_waiting=max_waiting,
                                 replica_cpus=replica_cpus, drain_timeout=drain_timeout,
                                 metrics_dir=settings.metrics_dir)
    return EngineDeployment.options(**options).bind(settings)


def _composed(overrides: list[str]):
    from mtpflow.config import compose, validate
    from mtpflow.serve.build import serving_overrides

    cfg = compose(serving_overrides(overrides))
    validate(cfg)  # a bad override is one line here, before Ray starts
    return cfg


def _max_waiting(cfg) -> int:
    """``engine.max_waiting`` (or its old spelling ``max_waiting``): Serve's queue bound per replica."""
    from mtpflow.engine import Admission

    return Admission.from_config(cfg).max_waiting


def build(args: dict):
    """``serve run mtpflow.serve.ray_app:build [replicas=N | min_replicas=A max_replicas=B]
    [overrides='strategy=pld max_batch_size=16'] [target_ongoing_requests=T] [replica_cpus=C]
    [served_model_name=NAME] [drain_timeout=S]``: the application for Serve's CLI (its HTTP options, 127.0.0.1:8000
    unless a config file says otherwise). The API key comes from ``MTPFLOW_API_KEY``."""
    known = {"replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "replica_cpus", "overrides",
             "served_model_name", "drain_timeout"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")

    def number(key, kind):
        return None if args.get(key) in (None, "") else kind(args[key])

    overrides = shlex.split(args.get("overrides") or "")
    cfg = _composed(overrides)
    scaling = Scaling(number("replicas", int), number("min_replicas", int), number("max_replicas", int),
                      number("target_ongoing_requests", float))
    if scaling.replicas is None and not scaling.autoscaled:
        scaling = Scaling(replicas=1)
    cpus = number("replica_cpus", float) or 1.0
    settings = ReplicaSettings(tuple(overrides), args.get("served_model_name") or None,
                               os.environ.get("MTPFLOW_API_KEY") or None,
                               tempfile.mkdtemp(prefix="mtpflow-serve-metrics-"), max(1, int(cpus)))
    return application(scaling, settings, max_batch_size=int(cfg.get("max_batch_size", 8)),
                       max_waiting=_max_waiting(cfg), replica_cpus=cpus,
                       drain_timeout=number("drain_timeout", float) or 30.0)


# ----- python -m mtpflow.serve --ray ----------------------------------------------------------------------------------
def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_port_free(host: str, port: int) -> None:
    """Serve's proxy would fail to bind later, out of sight (the application still deploys): say it now."""
    from mtpflow.errors import UserError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port") from None


def _wait_until_answering(url: str, timeout: float) -> bool:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def _replica_states() -> dict[str, int]:
    status = serve.status()
    app = status.applications.get(APP_NAME)
    if app is None or DEPLOYMENT_NAME not in app.deployments:
        return {}
    return {str(getattr(k, "value", k)): int(v) for k, v in app.deployments[DEPLOYMENT_NAME].replica_states.items()
            if v}


def run_on_ray(args: argparse.Namespace) -> int:
    """Start a local Ray instance (or join ``--ray-address``), deploy the replicas behind Serve's HTTP proxy on
    ``--host:--port``, and serve until SIGTERM/SIGINT; then shut Serve down (replicas drain up to
    ``--drain-timeout`` seconds) and the local Ray instance with it."""
    import shutil

    import ray

    from mtpflow.errors import UserError

    try:
        scaling = Scaling(args.replicas, args.min_replicas, args.max_replicas, args.target_ongoing_requests)
        if scaling.replicas is None and not scaling.autoscaled:
            scaling = Scaling(replicas=1)
        if args.replica_cpus <= 0:
            raise UserError(f"--replica-cpus must be > 0, got {args.replica_cpus}")
        cfg = _composed(args.overrides)
    except UserError as exc:
        print(f"mtpflow.serve: error: {exc}", file=sys.stderr)
        return 2
    local = args.ray_address is None
    port = args.port or _free_port(args.host)
    if local:
        try:
            _check_port_free(args.host, port)
        except UserError as exc:
            print(f"mtpflow.serve: error: {exc}", file=sys.stderr)
            return 2
    metrics_dir = tempfile.mkdtemp(prefix="mtpflow-serve-metrics-")
    settings = ReplicaSettings(tuple(args.overrides), args.served_model_name,
                               args.api_key or os.environ.get("MTPFLOW_API_KEY") or None, metrics_dir,
                               max(1, int(args.replica_cpus)))
    app = application(scaling, settings, max_batch_size=int(cfg.get("max_batch_size", 8)),
                      max_waiting=_max_waiting(cfg), replica_cpus=args.replica_cpus,
                      drain_timeout=args.drain_timeout)

    stop = threading.Event()
    ready = False
    signals = []

    def on_signal(sig, _frame):
        signals.append(sig)
        if not ready or len(signals) > 1:  # still deploying, or a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        stop.set()

    try:
        if local:  # address="local": a new instance even where RAY_ADDRESS names a cluster
            cpus = max(os.cpu_count() or 1, math.ceil(scaling.high * args.replica_cpus))
            ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                     object_store_memory=OBJECT_STORE_BYTES, logging_level="WARNING")
        else:
            ray.init(address=args.ray_address, logging_level="WARNING")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        serve.start(http_options={"host": args.host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        probe = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
        if not _wait_until_answering(f"http://{probe}:{port}/health", 60.0):
            raise UserError(f"the application is deployed but nothing answers on {args.host}:{port}; see Ray "
                            "Serve's proxy log above")
        ready = True
        print(f"mtpflow.serve: Ray Serve running on http://{args.host}:{port} ({scaling.describe()}, "
              f"{args.replica_cpus:g} CPU each; Ray {'local' if local else args.ray_address}); "
              f"traces: one database per replica; API key {'required' if settings.api_key else 'not required'}",
              file=sys.stderr, flush=True)
        last = None
        while not stop.wait(2.0):
            try:
                states = _replica_states()
            except Exception as exc:  # the controller is busy or restarting: try again
                states = {"unknown": 0, str(exc).splitlines()[0][:80]: 0}
            if states != last:
                shown = ", ".join(f"{k} {v}" for k, v in sorted(states.items())) or "none"
                print(f"mtpflow.serve: replicas: {shown}", file=sys.stderr, flush=True)
                last = states
        print("mtpflow.serve: shutting down (replicas finish their requests, up to "
              f"{args.drain_timeout:g} s)", file=sys.stderr, flush=True)
        return 0
    except KeyboardInterrupt:
        return 130 if not ready else 0
    except UserError as exc:
        print(f"mtpflow.serve: error: {exc}", file=sys.stderr)
        return 2
    finally:
        try:
            if ray.is_initialized():
                # Deleting the application first lets each replica finish its requests (Serve's graceful shutdown,
                # up to --drain-timeout) while the proxy still carries their answers; serve.shutdown() alone
                # takes the proxy down with the connections still open.
                try:
                    serve.delete(APP_NAME)
                except TimeoutError:  # Serve waits 60 s at most
                    pass
                if local:
                    serve.shutdown()
        except KeyboardInterrupt:
            pass
        finally:
            if local and ray.is_initialized():
                ray.shutdown()
            shutil.rmtree(metrics_dir, ignore_errors=True)


__all__ = ["Scaling", "ReplicaSettings", "EngineReplica", "EngineDeployment", "ReplicaSetMetrics", "application",
           "build", "deployment_options", "record_replica_info", "replica_trace_db",
           "replica_trace_dbs", "run_on_ray"]
