"""Many replicas on Ray Serve (``python -m mtpflow.serve --ray``, ``mtpflow.serve.ray_app``).

Fast checks of the pieces: the scaling flags and Serve's deployment options, the replicas' trace database names,
the health check that sees a dead decoding thread, and ``/metrics`` over several replica processes (the
multiprocess directory and every replica's trace database). Then one end-to-end test on the default model: a
local Ray instance with 2 replicas behind one endpoint, 8 concurrent ``openai`` clients x 4 requests, one
replica's process SIGKILLed mid-load; every request is answered (retries allowed) with exactly the text the
CLI's code path gives, Serve starts a new replica, ``/metrics`` shows both, and SIGTERM leaves no process behind.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'mtpflow[ray]' (the dev extra has it)")

import httpx  # noqa: E402

from mtpflow.errors import UserError  # noqa: E402
from mtpflow.serve.ray_app import (EngineDeployment, Scaling, deployment_options,  # noqa: E402
                                   replica_trace_db, replica_trace_dbs)
from server_process import REPO  # noqa: E402


# ----- the pieces -----------------------------------------------------------------------------------------------------
def test_fixed_and_autoscaled_deployment_options():
    fixed = deployment_options(Scaling(replicas=2), max_batch_size=8, max_waiting=64, replica_cpus=1.0,
                               drain_timeout=20, metrics_dir="/tmp/m")
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 8 and fixed["max_queued_requests"] == 64
    assert fixed["graceful_shutdown_timeout_s"] == 20.0
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0,
                                          "runtime_env": {"env_vars": {"PROMETHEUS_MULTIPROC_DIR": "/tmp/m"}}}
    auto = deployment_options(Scaling(min_replicas=1, max_replicas=4), max_batch_size=8, max_waiting=64,
                              replica_cpus=0.5, drain_timeout=30, metrics_dir=None)
    assert "num_replicas" not in auto and "runtime_env" not in auto["ray_actor_options"]
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                          "target_ongoing_requests": 8}
    to_zero = deployment_options(Scaling(min_replicas=0, max_replicas=2, target_ongoing_requests=3), max_batch_size=8,
                                 max_waiting=64, replica_cpus=1, drain_timeout=30, metrics_dir=None)
    assert to_zero["autoscaling_config"]["initial_replicas"] == 1
    assert to_zero["autoscaling_config"]["target_ongoing_requests"] == 3
    for options in (fixed, auto, to_zero):
        EngineDeployment.options(**options)  # Serve validates every field here
    assert Scaling(max_replicas=3).low == 1 and Scaling(max_replicas=3).high == 3
    for bad in ({"replicas": 2, "max_replicas": 3}, {"replicas": 0}, {"min_replicas": 3, "max_replicas": 2},
                {"max_replicas": 0}, {"max_replicas": 2, "target_ongoing_requests": 0},
                {"replicas": 2, "target_ongoing_requests": 4}):
        with pytest.raises(UserError):
            Scaling(**bad)


def test_ray_flags_need_ray():
    from mtpflow.serve.__main__ import parse_args

    args = parse_args(["--ray", "--min-replicas", "1", "--max-replicas", "3", "strategy=pld"])
    assert args.ray and (args.min_replicas, args.max_replicas, args.overrides) == (1, 3, ["strategy=pld"])
    with pytest.raises(SystemExit):
        parse_args(["--replicas", "2"])


def test_a_taken_port_is_one_line_before_ray_starts():
    from server_process import bound_socket

    sock = bound_socket()
    sock.listen()
    try:
        out = subprocess.run([sys.executable, "-m", "mtpflow.serve", "--ray", "--port", str(sock.getsockname()[1]),
                              "trace=off"], cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "MTPFLOW_LOAD_PLUGINS": ""})
    finally:
        sock.close()
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("mtpflow.serve: error: cannot listen on 127.0.0.1:")
    assert "Traceback" not in out.stderr and "Ray" not in out.stderr  # no Ray instance was started


def test_replica_trace_databases(tmp_path):
    base = tmp_path / "traces.db"
    assert replica_trace_db(base, 0) == tmp_path / "traces.replica-0.db"
    assert replica_trace_db(tmp_path / "runs", "x1") == tmp_path / "runs.replica-x1.db"
    for name in ("traces.replica-0.db", "traces.replica-1.db", "traces.replica-1.db-wal", "traces.db",
                 "other.replica-2.db"):
        (tmp_path / name).touch()
    assert replica_trace_dbs(base) == {"0": tmp_path / "traces.replica-0.db", "1": tmp_path / "traces.replica-1.db"}
    assert replica_trace_dbs(tmp_path / "missing" / "traces.db") == {}


def test_health_check_sees_a_dead_decoding_thread():
    from mtpflow.engine import Engine

    engine = Engine.__new__(Engine)  # only the fields Engine.healthy reads (no model)
    engine._lock = threading.Condition()
    engine._queue, engine._running, engine._thread = collections.deque(), [], None
    assert engine.healthy()  # idle: the thread ended and said so
    stop = threading.Event()
    engine._thread = threading.Thread(target=stop.wait)
    engine._thread.start()
    assert engine.healthy()
    stop.set()
    engine._thread.join()
    assert not engine.healthy()  # it ended without clearing itself: it crashed
    engine._thread = None
    engine._queue.append("a request")
    assert not engine.healthy()  # work waits and nothing will run it


METRICS_WRITER = """
import sys
from mtpflow.serve.metrics import ServerMetrics
from mtpflow.serve.ray_app import record_replica_info

class Engine:
    num_running, num_waiting = 3, 1

m = ServerMetrics(Engine())
m.requests.labels("/v1/completions", "complete").inc(int(sys.argv[2]))
m.running.set(Engine.num_running)
record_replica_info(sys.argv[1], "id-" + sys.argv[1])
print("ready", flush=True)
sys.stdin.read()  # live until the test closes stdin
"""

METRICS_READER = """
import sys
from mtpflow.serve.ray_app import ReplicaSetMetrics
print(ReplicaSetMetrics(sys.argv[1], sys.argv[2]).exposition().decode())
"""


def test_metrics_of_every_replica_process(tmp_path):
    """Two replica processes share the multiprocess directory; one dies. /metrics sums both counters, keeps the
    live one's gauges only, and shows each replica database's trace metrics under its ``replica`` label."""
    from mtpflow.traces.store import TraceStore

    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "MTPFLOW_LOAD_PLUGINS": ""}
    base = tmp_path / "traces.db"
    for rank, runs in (("0", 2), ("1", 1)):
        store = TraceStore(replica_trace_db(base, rank))
        for _ in range(runs):
            run = store.start_run(strategy="pld", config={}, model_id="m", prompt="p", prompt_tokens=1,
                                  package_version="0")
            store.finish_run(run, "complete", output_text="x", stats={})
        store.close()
    live = subprocess.Popen([sys.executable, "-c", METRICS_WRITER, "0", "5"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "ready"
        gone = subprocess.Popen([sys.executable, "-c", METRICS_WRITER, "1", "2"], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert gone.stdout.readline().strip() == "ready"
        gone.kill()
        gone.wait(30)
        out = subprocess.run([sys.executable, "-c", METRICS_READER, str(metrics_dir), str(base)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        text = out.stdout
    finally:
        live.stdin.close()
        live.wait(30)
    assert 'mtpflow_server_requests_total{endpoint="/v1/completions",outcome="complete"} 7.0' in text
    assert re.search(rf'mtpflow_server_replica_info{{pid="{live.pid}",replica="0",replica_id="id-0"}} 1\.0', text)
    assert "replica_id=\"id-1\"" not in text  # the dead process's live gauges are gone
    running = re.findall(r'^mtpflow_server_requests_running\{pid="(\d+)"\} (\S+)$', text, re.M)
    assert running == [(str(live.pid), "3.0")]
    assert 'mtpflow_runs_total{replica="0",status="complete",strategy="pld"} 2.0' in text
    assert 'mtpflow_runs_total{replica="1",status="complete",strategy="pld"} 1.0' in text
    assert text.count("# TYPE mtpflow_runs_total counter") == 1  # one family, both replicas in it


# ----- end to end on the default model --------------------------------------------------------------------------------
NEW_TOKENS = 16
PROMPTS = [
    "Summarize: The meeting moved from Tuesday to Thursday at 3 pm because the client asked for more time.",
    "Rename the variable x to total:\n\ndef f(values):\n    x = 0\n    for v in values:\n        x += v\n    return x",
    "What is the capital of France?",
    "Give me three tips for staying focused while working.",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "List the days of the week.",
    "def fibonacci(n):",
    "Explain what a hash table is in one sentence.",
]
# per client: (chat, strategy, stream, strategy by model id rather than extra_body)
PLAN = [(True, "baseline", False, True), (False, "pld", False, False), (True, "pld", True, True),
        (False, "baseline", False, False)]

# The CLI's code path (mtpflow.cli: a Pipeline per config, one request at a time), every case on one loaded
# model. One torch thread, as in a replica with one CPU, so the machine measurements it caches (CPU linear plans,
# verify costs) are the ones the replicas read instead of timing them again.
REFERENCE_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from mtpflow.api import Pipeline
from mtpflow.config import compose, validate
from mtpflow.engine import Engine
cases, new = json.loads(sys.stdin.read()), int(sys.argv[1])
engine, pipes, texts = None, {}, []
for prompt, chat, strategy in cases:
    if (chat, strategy) not in pipes:
        cfg = compose([f"strategy={strategy}", "trace=off", f"max_new_tokens={new}", f"chat={str(chat).lower()}"])
        validate(cfg)
        engine = engine or Engine(cfg)
        pipes[chat, strategy] = Pipeline(cfg, engine=engine)
    texts.append(pipes[chat, strategy](prompt).text)
print(json.dumps(texts))
"""


def cli_reference(cases: list[tuple[str, bool, str]]) -> dict:
    out = subprocess.run([sys.executable, "-c", REFERENCE_SCRIPT, str(NEW_TOKENS)], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=400, cwd=REPO,
                         env={**os.environ, "MTPFLOW_LOAD_PLUGINS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(map(tuple, cases), json.loads(out.stdout.strip().splitlines()[-1])))


def descendants(pid: int) -> dict[int, str]:
    import psutil

    found = {}
    try:
        for p in psutil.Process(pid).children(recursive=True):
            try:
                found[p.pid] = " ".join(p.cmdline())[:120]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    except psutil.NoSuchProcess:
        pass
    return found


def replica_pids(pid: int) -> set[int]:
    return {p for p, cmd in descendants(pid).items() if cmd.startswith("ray::ServeReplica:mtpflow")}


def resident_mb(pid: int) -> dict[str, int]:
    """Resident memory of the server's processes: the replicas, and the driver with Ray's own."""
    import psutil

    out = {"replicas": 0, "driver and Ray": 0}
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            rss = p.memory_info().rss >> 20
            out["replicas" if " ".join(p.cmdline()).startswith("ray::ServeReplica") else "driver and Ray"] += rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def running_by_pid(metrics: str) -> dict[int, float]:
    return {int(p): float(v) for p, v in
            re.findall(r'^mtpflow_server_requests_running\{pid="(\d+)"\} (\S+)$', metrics, re.M)}


def completed_by_pid(metrics: str) -> dict[int, float]:
    """Runs each replica process has completed (its trace database's count, joined to its pid by rank)."""
    rank_of = {r: int(p) for p, r in re.findall(r'^mtpflow_server_replica_info\{pid="(\d+)",replica="(\d+)"', metrics, re.M)}
    done: dict[int, float] = collections.Counter()
    for rank, value in re.findall(r'^mtpflow_runs_total\{replica="(\d+)",status="complete",strategy="\w+"\} (\S+)$',
                                  metrics, re.M):
        if rank in rank_of:
            done[rank_of[rank]] += float(value)
    return done


class RayServer:
    """``python -m mtpflow.serve --ray ...`` in its own session (so the test can end every process it started)."""

    def __init__(self, log_path: Path, *args: str, timeout: float = 420.0):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MTPFLOW_LOAD_PLUGINS": "", "RAY_USAGE_STATS_ENABLED": "0"}
        self.proc = subprocess.Popen([sys.executable, "-m", "mtpflow.serve", "--ray", "--port", "0", *args],
                                     cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.seen: dict[int, str] = {}
        deadline = time.time() + timeout
        while True:
            self.remember()
            m = re.search(r"Ray Serve running on (http://[\d.]+:\d+)", self.log())
            if m:
                self.url = m.group(1)
                break
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill_all()
                raise RuntimeError(f"the Ray server did not start (exit {self.proc.poll()}):\n{self.log()[-4000:]}")
            time.sleep(1)

    def log(self) -> str:
        return self.log_path.read_bytes().decode("utf-8", "replace")

    def remember(self) -> None:
        """Note every process under the server (Ray's own and the replicas) to check that none outlives it."""
        self.seen.update(descendants(self.proc.pid))

    def leftovers(self) -> dict[int, str]:
        import psutil

        alive = {}
        for pid, cmd in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE and " ".join(p.cmdline())[:120] == cmd:
                    alive[pid] = cmd
            except psutil.NoSuchProcess:
                pass
        return alive

    def kill_all(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session started for it: the driver and Ray
        except ProcessLookupError:
            pass
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self._log.close()


@pytest.mark.default_model
@pytest.mark.timeout(900)
def test_two_replicas_survive_a_killed_replica(tmp_path):
    import openai

    started = time.time()
    cases = sorted({(PROMPTS[i], chat, strategy) for i in range(len(PROMPTS)) for chat, strategy, _, _ in PLAN})
    reference = cli_reference([list(c) for c in cases])
    reference_seconds = time.time() - started

    server = RayServer(tmp_path / "server.log", "--replicas", "2", "--replica-cpus", "1",
                       f"trace.db={tmp_path / 'traces.db'}")
    startup_seconds = time.time() - started - reference_seconds
    try:
        statuses = collections.Counter()
        hook = {"response": [lambda r: statuses.update([r.status_code])]}
        first = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=8)
        model = first.models.list().data[0].id
        results, errors, attempts = {}, [], collections.Counter()

        def ask(c, prompt, chat, strategy, stream, by_model_id) -> str:
            kwargs = {"max_tokens": NEW_TOKENS, "temperature": 0}
            if by_model_id:
                kwargs["model"] = f"{model}:{strategy}"
            else:
                kwargs["model"], kwargs["extra_body"] = model, {"mtpflow": {"strategy": strategy}}
            for attempt in range(4):
                attempts[prompt, chat, strategy] += 1
                try:
                    if chat:
                        messages = [{"role": "user", "content": prompt}]
                        if stream:  # a stream cut by the kill is not retried by the client: start it again
                            chunks = list(c.chat.completions.create(messages=messages, stream=True, **kwargs))
                            if not any(ch.choices and ch.choices[0].finish_reason for ch in chunks):
                                raise RuntimeError("the stream ended without a finish reason")
                            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                        return c.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
                    return c.completions.create(prompt=prompt, **kwargs).choices[0].text
                except (openai.APIError, httpx.HTTPError, RuntimeError):
                    if attempt == 3:
                        raise
                    time.sleep(1)

        def worker(i: int):
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=8,
                              http_client=httpx.Client(event_hooks=hook, timeout=120))
            try:
                for j, (chat, strategy, stream, by_model_id) in enumerate(PLAN):
                    results[i, j] = (PROMPTS[i], chat, strategy,
                                     ask(c, PROMPTS[i], chat, strategy, stream, by_model_id))
            except Exception as exc:  # collected: an assertion in a thread would be lost
                errors.append(f"client {i}: {exc!r}")

        before = replica_pids(server.proc.pid)
        assert len(before) == 2, server.log()[-3000:]
        server.remember()
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        # mid-load: once some answers are in, kill a replica that has requests in its running batch and has
        # already completed some (so the test can see that a dead replica's counts stay in the sums)
        victim, in_flight, deadline = None, 0.0, time.time() + 300
        while victim is None and time.time() < deadline and any(t.is_alive() for t in threads):
            if len(results) >= 4:
                metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
                running, completed = running_by_pid(metrics), completed_by_pid(metrics)
                busy = [pid for pid in before if running.get(pid, 0) > 0 and completed.get(pid, 0) > 0]
                if busy:
                    victim, in_flight = busy[0], running[busy[0]]
                    os.kill(victim, signal.SIGKILL)
                    answered_at_kill = len(results)
                    break
            time.sleep(0.3)
        assert victim is not None, f"no replica was seen with requests running; answers so far: {len(results)}"
        for t in threads:
            t.join(timeout=420)
        assert not any(t.is_alive() for t in threads), "a client is still waiting"
        assert not errors, errors
        assert len(results) == 32  # none lost
        for (i, j), (prompt, chat, strategy, text) in sorted(results.items()):
            assert text == reference[prompt, chat, strategy], (i, j, strategy, chat)
        load_done = time.time()

        # Serve replaces the killed replica: two replicas again, a new process in the dead one's place
        deadline, after, metrics = time.time() + 300, set(), ""
        while time.time() < deadline:
            server.remember()
            after = replica_pids(server.proc.pid)
            if len(after) == 2 and victim not in after:
                metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
                shown = {int(p) for p in re.findall(r'^mtpflow_server_replica_info\{pid="(\d+)"', metrics, re.M)}
                if shown == after and "replicas: RUNNING 2" in server.log().rsplit("STARTING", 1)[-1]:
                    break
            time.sleep(2)
        else:
            pytest.fail(f"Serve did not bring back 2 replicas (now {after}):\n{server.log()[-3000:]}")
        restart_seconds = time.time() - load_done
        replicas = set(re.findall(r'^mtpflow_server_replica_info\{pid="\d+",replica="(\d+)"', metrics, re.M))
        assert replicas == {"0", "1"}  # the new replica took the dead one's rank
        completed = sum(float(v) for v in re.findall(
            r'^mtpflow_server_requests_total\{endpoint="[^"]+",outcome="complete"\} (\S+)$', metrics, re.M))
        assert completed >= 32  # the dead replica's counts stay in the sums
        for rank in ("0", "1"):
            assert re.search(rf'^mtpflow_runs_total{{replica="{rank}",status="complete",strategy="\w+"}} ', metrics,
                             re.M), rank
        # one trace database per replica (rank), every answered request recorded in one of them
        dbs = replica_trace_dbs(tmp_path / "traces.db")
        assert set(dbs) == {"0", "1"}
        recorded = sum(sqlite3.connect(db).execute("SELECT count(*) FROM runs WHERE status = 'complete'").fetchone()[0]
                       for db in dbs.values())
        assert recorded >= 32
        # one endpoint still answers, on either replica
        again = first.completions.create(model=model, prompt=PROMPTS[6], max_tokens=NEW_TOKENS, temperature=0)
        assert again.choices[0].text == reference[PROMPTS[6], False, "baseline"]

        memory = resident_mb(server.proc.pid)
        server.remember()

        # SIGTERM while requests decode: they finish (Serve's graceful shutdown), then every process exits
        late = {}

        def long_request(k: int):
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=180, max_retries=0)
            try:
                r = c.completions.create(model=model, prompt=PROMPTS[k], max_tokens=48, temperature=0)
                late[k] = (r.choices[0].finish_reason, r.usage.completion_tokens)
            except Exception as exc:  # collected, checked below
                late[k] = repr(exc)

        closing = [threading.Thread(target=long_request, args=(k,), daemon=True) for k in (0, 1)]
        for t in closing:
            t.start()
        deadline = time.time() + 120
        while time.time() < deadline and sum(running_by_pid(httpx.get(f"{server.url}/metrics", timeout=30).text)
                                              .values()) < 2 and not late:
            time.sleep(0.2)
        stopping = time.time()
        server.proc.send_signal(signal.SIGTERM)
        for t in closing:
            t.join(timeout=180)
        assert set(late) == {0, 1} and all(isinstance(v, tuple) and v[1] > 0 for v in late.values()), late
        assert server.proc.wait(180) == 0, server.log()[-3000:]
        deadline = time.time() + 60
        while server.leftovers() and time.time() < deadline:
            time.sleep(1)
        assert not server.leftovers(), server.leftovers()
        print(f"\nshutdown {time.time() - stopping:.0f} s; resident MB {memory}; reference {reference_seconds:.0f} s, Ray + 2 replicas up {startup_seconds:.0f} s, load "
              f"{load_done - started - reference_seconds - startup_seconds:.0f} s, restart {restart_seconds:.0f} s; "
              f"killed pid {victim} with {in_flight:.0f} running after {answered_at_kill} answers; HTTP statuses "
              f"{dict(statuses)}; attempts beyond the first {sum(attempts.values()) - 32}")
    finally:
        server.kill_all()
