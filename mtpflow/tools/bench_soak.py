"""The soak benchmark of the server: ``python -m mtpflow.bench mode=soak minutes=30 clients=16`` starts
``python -m mtpflow.serve`` as a real process (default model, traces on with the server's sampling and retention,
``trace=serve``) and keeps ``clients`` workers of the official ``openai`` client busy for ``minutes``: lossless
strategies mixed per request (``mtpflow.strategy``), streamed and plain answers, some streams closed mid-way.
Every prompt is one of the suite's, numbered so that no request repeats an earlier one (first-time requests: the
prefix cache and the suffix cache never see the same prompt twice).

Per minute it reports the server's resident memory (psutil, the process and its children), p50/p99 latency and
time to first token, requests answered / refused (429) / failed, and trace rows written against requests
answered (the runs table, read through the trace store's SQLAlchemy models). At the end the clients stop, the
traces are flushed, the server is killed with SIGKILL and started again on the same database, which must open,
pass SQLite's integrity check and list every run. A CSV, a PNG and the manifest go to ``out``; the must-hold
verdicts of issue 48 are printed and recorded in the manifest:

- resident memory of the last 10 minutes within 5 % of minute 10 (growth; less memory passes);
- p99 latency of the last 10 minutes within 20 % of minutes 5-15 (growth; faster passes);
- 0 failed requests; trace rows = requests answered; the database intact after the SIGKILL.

Shorter than 30 minutes, a "minute" is ``minutes / 30`` of a real one, so the same windows apply (a 0.3-minute
run reports 30 rows of 0.6 s); longer runs keep real minutes and the last 10 of them.

    python -m mtpflow.bench mode=soak minutes=30 clients=16 out=docs/bench/soak_dec05
"""
from __future__ import annotations

import math
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtpflow.errors import ConfigError, UserError, check_int, check_range, describe, run_command, writable_folder
from mtpflow.tools.bench_serve import (Server, parse_options, percentile, save_figure, server_overrides,
                                       write_manifest)

DEFAULTS = {
    "mode": "soak",
    "minutes": 30,
    "clients": 16,
    "strategies": ["baseline", "pld", "mtp"],  # lossless ones: the server's answers stay greedy's
    "stream_share": 0.5,  # share of requests streamed
    "cancel_share": 0.2,  # share of the streams closed after 1-8 chunks
    "max_new_tokens": 64,
    "prompts": None,  # a JSONL file (id, class, prompt); default: the shipped suite
    "model": None,  # model.name for the server (default: the default model)
    "overrides": [],  # more server overrides, e.g. ["trace.retention.max_runs=500"]
    "seed": 0,
    "out": "bench-results",
    "startup_timeout": 600,
}
FILES = ("soak.csv", "soak.png")
MEMORY_GROWTH, P99_GROWTH = 0.05, 0.20  # the bounds


@dataclass
class Outcome:
    """One request as its client saw it (seconds from the start of the soak)."""

    start: float
    end: float
    strategy: str
    stream: bool
    result: str  # answered | refused | failed
    cancelled: bool = False
    ttft: float | None = None
    error: str | None = None


@dataclass
class Soak:
    """What the workers and the memory sampler collect."""

    outcomes: list[Outcome] = field(default_factory=list)
    memory: list[tuple[float, float]] = field(default_factory=list)  # (seconds, resident MB)
    lock: threading.Lock = field(default_factory=threading.Lock)


def windows(minutes: float) -> tuple[float, int]:
    """(seconds per reported minute, number of reported minutes): real minutes from 30 on, else 30 rows of
    ``minutes / 30`` of a minute."""
    period = 60.0 if minutes >= 30 else 2.0 * minutes
    return period, max(1, math.ceil(round(minutes * 60 / period, 6)))


def resident_mb(pid: int) -> float:
    """The server's resident memory: the process and its children (MB)."""
    import psutil

    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def one_request(client, model: str, prompt: str, strategy: str, stream: bool, cancel_after: int | None,
                max_tokens: int, t0: float) -> Outcome:
    """A chat completion through the openai client; a 429 is ``refused``, any other error ``failed``."""
    import openai

    start = time.perf_counter() - t0
    out = Outcome(start, start, strategy, stream, "answered")
    messages = [{"role": "user", "content": prompt}]
    extra = {"mtpflow": {"strategy": strategy}}
    try:
        if stream:
            chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True, extra_body=extra)
            seen = 0
            try:
                for chunk in chunks:
                    if chunk.choices and chunk.choices[0].delta.content:
                        seen += 1
                        if out.ttft is None:
                            out.ttft = time.perf_counter() - t0 - start
                        if cancel_after is not None and seen >= cancel_after:
                            out.cancelled = True
                            break
            finally:
                chunks.close()  # a cancelled stream: the server sees the connection close mid-answer
        else:
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                   temperature=0, extra_body=extra)
            if not reply.choices:
                raise UserError("an answer without choices")
    except openai.RateLimitError:
        out.result = "refused"
    except Exception as exc:  # noqa: BLE001 - every other error is a failed request, counted and reported
        out.result, out.error = "failed", describe(exc)
    out.end = time.perf_counter() - t0
    return out


def drive(server: Server, model: str, prompts: list[str], opts, t0: float, soak: Soak, progress) -> None:
    """``clients`` workers, each its own openai client, sending until ``minutes`` have passed; the memory
    sampler reads the server's resident memory every few seconds meanwhile."""
    import openai

    seconds = float(opts.minutes) * 60
    period, _ = windows(float(opts.minutes))
    numbers = iter(range(10**12))
    numbers_lock = threading.Lock()
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            try:
                soak.memory.append((time.perf_counter() - t0, resident_mb(server.proc.pid)))
            except Exception:  # noqa: BLE001 - the server died: the workers report it as failed requests
                pass
            stop.wait(min(5.0, period / 3))

    def worker(index: int) -> None:
        rng = random.Random(int(opts.seed) * 1000 + index)
        client = openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="soak", max_retries=0,
                               timeout=600.0)
        try:
            while time.perf_counter() - t0 < seconds:
                with numbers_lock:
                    n = next(numbers)
                prompt = f"Request {n}. {prompts[n % len(prompts)]}"
                stream = rng.random() < float(opts.stream_share)
                cancel = rng.randint(1, 8) if stream and rng.random() < float(opts.cancel_share) else None
                out = one_request(client, model, prompt, rng.choice(list(opts.strategies)), stream, cancel,
                                  int(opts.max_new_tokens), t0)
                with soak.lock:
                    soak.outcomes.append(out)
                progress.update(1)
                if out.result == "refused":
                    time.sleep(1.0)  # the server's Retry-After
        finally:
            client.close()

    threads = [threading.Thread(target=sampler, daemon=True)]
    threads += [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(int(opts.clients))]
    for thread in threads:
        thread.start()
    for thread in threads[1:]:
        thread.join()
    stop.set()
    threads[0].join()


def trace_runs(db: Path, since: float) -> list[tuple[int, float | None, str]]:
    """(id, finished_at, status) of every run started since ``since`` (unix seconds), from the trace store."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from mtpflow.traces.store import Run, TraceStore

    store = TraceStore(db)
    try:
        with Session(store.engine) as session:
            return [tuple(row) for row in session.execute(
                select(Run.id, Run.finished_at, Run.status).where(Run.started_at >= since).order_by(Run.id))]
    finally:
        store.close()


def wait_for_traces(db: Path, since: float, answered: int, timeout: float = 30.0) -> list:
    """The runs once every answered request's run has finished in the database (the recorder flushes every
    ``trace.flush_seconds``), or whatever is there after ``timeout``."""
    deadline = time.time() + timeout
    while True:
        runs = trace_runs(db, since)
        if sum(r[2] != "running" for r in runs) >= answered or time.time() > deadline:
            return runs
        time.sleep(0.5)


def reopen_after_kill(db: Path, listed: set[int], overrides: list[str], log: Path, timeout: float) -> dict:
    """Start the server again on the database a SIGKILL left behind, then open the store: it must open, pass
    ``PRAGMA integrity_check`` and list every run listed before the kill."""
    from sqlalchemy import text

    from mtpflow.traces.store import TraceStore

    try:
        restarted = Server(overrides, log, timeout)
        try:
            store = TraceStore(db)
            try:
                with store.engine.connect() as conn:
                    integrity = conn.execute(text("PRAGMA integrity_check")).scalar()
                ids = {r["id"] for r in store.list_runs(limit=store.count("runs") + 1)}
            finally:
                store.close()
        finally:
            restarted.stop()
    except Exception as exc:  # noqa: BLE001 - a database the restart cannot open is the finding, not a crash
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {"db_integrity": f"not opened: {line}", "db_runs_listed": 0, "db_runs_missing": len(listed),
                "db_intact": False}
    missing = sorted(listed - ids)
    return {"db_integrity": integrity, "db_runs_listed": len(ids & listed), "db_runs_missing": len(missing),
            "db_intact": integrity == "ok" and not missing}


def minute_of(seconds: float, minutes: float) -> int:
    """The reported minute (0-based) ``seconds`` after the start fall in; what ends after the last minute (a
    request sent just before the end) counts in the last."""
    period, count = windows(minutes)
    return min(count - 1, max(0, int(seconds // period)))


def per_minute(soak: Soak, runs: list, t0_wall: float, minutes: float) -> list[dict]:
    """One row per reported minute: memory, latency and time to first token, outcomes, trace rows."""
    period, count = windows(minutes)

    def index(seconds: float) -> int:
        return minute_of(seconds, minutes)

    buckets = [{"answered": [], "refused": 0, "failed": 0, "cancelled": 0, "ttft": [], "memory": [], "traces": 0}
               for _ in range(count)]
    for o in soak.outcomes:
        b = buckets[index(o.end)]
        if o.result == "answered":
            b["answered"].append(o)
            b["cancelled"] += o.cancelled
            if o.ttft is not None:
                b["ttft"].append(o.ttft)
        else:
            b[o.result] += 1
    for seconds, mb in soak.memory:
        buckets[index(seconds)]["memory"].append(mb)
    for _, finished, status in runs:
        if status != "running" and finished is not None:
            buckets[index(finished - t0_wall)]["traces"] += 1
    rows, answered_total, traces_total = [], 0, 0
    for i, b in enumerate(buckets):
        latencies = [o.end - o.start for o in b["answered"] if not o.cancelled]
        answered_total += len(b["answered"])
        traces_total += b["traces"]
        rows.append({
            "minute": i + 1, "seconds": round((i + 1) * period, 2),
            "rss_mb": round(b["memory"][-1], 1) if b["memory"] else float("nan"),
            "rss_max_mb": round(max(b["memory"]), 1) if b["memory"] else float("nan"),
            "latency_p50_s": round(percentile(latencies, 0.5), 3), "latency_p99_s": round(percentile(latencies, 0.99), 3),
            "ttft_p50_s": round(percentile(b["ttft"], 0.5), 3), "ttft_p99_s": round(percentile(b["ttft"], 0.99), 3),
            "answered": len(b["answered"]), "cancelled": b["cancelled"], "refused": b["refused"], "failed": b["failed"],
            "trace_rows": b["traces"], "answered_total": answered_total, "trace_rows_total": traces_total,
        })
    return rows


def verdicts(rows: list[dict], soak: Soak, runs: list, db: dict, minutes: float) -> dict:
    """The issue's must-hold checks, computed over the reported minutes (scaled when ``minutes < 30``)."""
    count = len(rows)
    last = range(max(0, count - 10), count)  # the last 10 minutes
    ref = min(9, count - 1)  # minute 10
    early = range(min(4, count - 1), min(15, count))  # minutes 5-15

    def latencies(window: range) -> list[float]:
        return [o.end - o.start for o in soak.outcomes if o.result == "answered" and not o.cancelled
                and minute_of(o.end, minutes) in window]

    ref_mb = rows[ref]["rss_max_mb"]
    last_mb = max((rows[i]["rss_max_mb"] for i in last if not math.isnan(rows[i]["rss_max_mb"])), default=float("nan"))
    memory_growth = last_mb / ref_mb - 1 if ref_mb and not math.isnan(ref_mb) else float("nan")
    p99_early, p99_last = percentile(latencies(early), 0.99), percentile(latencies(last), 0.99)
    p99_growth = p99_last / p99_early - 1 if p99_early and not math.isnan(p99_early) else float("nan")
    answered = sum(o.result == "answered" for o in soak.outcomes)
    failed = sum(o.result == "failed" for o in soak.outcomes)
    trace_rows = sum(r[2] != "running" for r in runs)
    return {
        "requests": len(soak.outcomes), "answered": answered,
        "cancelled": sum(o.cancelled for o in soak.outcomes),
        "refused": sum(o.result == "refused" for o in soak.outcomes), "failed": failed,
        "memory_minute10_mb": ref_mb, "memory_last10_max_mb": last_mb, "memory_growth": round(memory_growth, 4),
        "memory_ok": memory_growth <= MEMORY_GROWTH,
        "p99_minutes5_15_s": round(p99_early, 3), "p99_last10_s": round(p99_last, 3), "p99_growth": round(p99_growth, 4),
        "p99_ok": p99_growth <= P99_GROWTH,
        "failed_ok": failed == 0,
        "trace_rows": trace_rows, "trace_rows_ok": trace_rows == answered,
        **db, "db_ok": bool(db.get("db_intact")),
    }


def plot(table, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    x = table["minute"]
    axes[0].plot(x, table["rss_max_mb"], marker=".", label="max")
    axes[0].plot(x, table["rss_mb"], linestyle="--", label="end of minute")
    for ax, name in ((axes[1], "latency"), (axes[2], "ttft")):
        ax.plot(x, table[f"{name}_p99_s"], marker=".", label="p99")
        ax.plot(x, table[f"{name}_p50_s"], marker=".", linestyle="--", label="p50")
    for column in ("answered", "cancelled", "refused", "failed", "trace_rows"):
        axes[3].plot(x, table[column], marker=".", label=column)
    for ax, label in zip(axes, ("server resident memory (MB)", "request latency (s)", "time to first token (s)",
                                "requests per minute")):
        ax.set_xlabel("minute")
        ax.set_ylabel(label)
    save_figure(fig, axes, path, title)


def check_options(opts) -> None:
    from omegaconf import ListConfig

    for name in ("strategies", "overrides"):
        if opts[name] is not None and not isinstance(opts[name], ListConfig):
            opts[name] = [opts[name]]
    check_range("minutes", opts.minutes, 0, None, low_inclusive=False)
    check_int("clients", opts.clients, 1, 1024)
    check_int("max_new_tokens", opts.max_new_tokens, 1)
    check_int("startup_timeout", opts.startup_timeout, 1)
    check_range("stream_share", opts.stream_share, 0, 1)
    check_range("cancel_share", opts.cancel_share, 0, 1)
    if not opts.strategies:
        raise ConfigError("strategies must name at least one strategy, e.g. strategies=[baseline,pld,mtp]")
    from mtpflow.config import available_strategies

    unknown = [s for s in opts.strategies if s not in available_strategies()]
    if unknown:
        raise UserError(f"unknown strategy {unknown[0]!r}; available: {', '.join(available_strategies())}")


def main(argv: list[str]) -> int:
    return run_command("mtpflow.bench", bench_soak, argv)


def bench_soak(argv: list[str]) -> int:
    """The command itself: check the options, start the server, soak it, kill it, reopen its database, write
    the results and print the verdicts."""
    opts = parse_options(argv, DEFAULTS, "for mode=soak")
    check_options(opts)
    out = Path(str(opts.out)).expanduser()
    writable_folder(out)
    from mtpflow.tools.specbench import load_prompt_suite

    prompts = [r["prompt"] for r in load_prompt_suite(opts.prompts, None, 0)]
    if not prompts:
        raise UserError("the prompt file holds no prompts")
    import pandas as pd
    from tqdm import tqdm

    tmp = Path(tempfile.mkdtemp(prefix="mtpflow-bench-soak-"))
    db = tmp / "traces.db"
    overrides = server_overrides(opts, f"trace.db={db}", f"max_batch_size={int(opts.clients)}")
    print(f"starting python -m mtpflow.serve {' '.join(overrides)} (log {tmp / 'server.log'})", file=sys.stderr)
    server, done = Server(overrides, tmp / "server.log", float(opts.startup_timeout)), False
    try:
        import openai

        with openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="soak", max_retries=0) as c:
            model = c.models.list().data[0].id
            for strategy in opts.strategies:  # warm-up, before the soak's clock starts
                c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                                          extra_body={"mtpflow": {"strategy": strategy}})
        soak, t0_wall, t0 = Soak(), time.time(), time.perf_counter()
        with tqdm(unit="req", desc=f"soak {opts.minutes} min, {opts.clients} clients") as progress:
            drive(server, model, prompts, opts, t0, soak, progress)
        answered = sum(o.result == "answered" for o in soak.outcomes)
        runs = wait_for_traces(db, t0_wall, answered)
        listed = {r[0] for r in runs}
        server.proc.kill()  # SIGKILL: no drain, no checkpoint
        server.proc.wait()
        server.stop()
        db_check = reopen_after_kill(db, listed, overrides, tmp / "server-restart.log", float(opts.startup_timeout))
        table = pd.DataFrame(per_minute(soak, runs, t0_wall, float(opts.minutes)))
        verdict = verdicts(table.to_dict("records"), soak, runs, db_check, float(opts.minutes))
        print(table.to_string(index=False))
        table.to_csv(out / FILES[0], index=False)
        plot(table, out / FILES[1], f"soak: python -m mtpflow.serve, {model}, {opts.clients} clients, "
                                    f"{opts.minutes} min, strategies {', '.join(opts.strategies)}")
        errors = sorted({o.error for o in soak.outcomes if o.error})[:5]
        path = write_manifest(out, argv, opts, overrides, model, len(prompts), mode="soak", files=FILES,
                              results={"verdicts": verdict, "errors": errors})
        print()
        for key, value in verdict.items():
            print(f"{key:>22}: {value}")
        for error in errors:
            print(f"failed request: {error}")
        holds = all(verdict[k] for k in ("memory_ok", "p99_ok", "failed_ok", "trace_rows_ok", "db_ok"))
        print(f"\nmust hold: {'yes' if holds else 'NO'}; wrote {out / FILES[0]}, {out / FILES[1]} and {path}")
        done = True
        return 0
    finally:
        server.stop()
        if done:  # the server's logs and traces stay behind only when something failed
            shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["main", "windows", "minute_of", "per_minute", "verdicts"]
