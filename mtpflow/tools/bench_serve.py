"""The load benchmark of the server: ``python -m mtpflow.bench mode=serve`` starts ``python -m mtpflow.serve`` as a
real process, then for each strategy and each concurrency (1, 4, 8, 16 clients) sends the prompt suite as
streaming chat completions and measures requests/s, output tokens/s, and p50/p95 time to first token and
end-to-end latency; a table, a CSV and a PNG.

    python -m mtpflow.bench mode=serve                                   # baseline and mtp, 1/4/8/16 clients
    python -m mtpflow.bench mode=serve "strategies=[baseline,pld]" "concurrency=[1,8]" requests=32 out=docs/bench

The clients are threads speaking HTTP with the standard library (no client package needed); every strategy
runs on the same server (``mtpflow.strategy`` per request), after one warm-up request each. ``identical`` is
the share of greedy answers equal to the first strategy's answer for the same prompt.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import OmegaConf

from mtpflow.errors import ConfigError, UserError, check_int, run_command, writable_folder

DEFAULTS = {
    "mode": "serve",
    "strategies": ["baseline", "mtp"],  # mtp: the recommended strategy (docs/strategies.md)
    "concurrency": [1, 4, 8, 16],
    "requests": 32,  # requests per strategy and concurrency (at least the concurrency)
    "max_new_tokens": 64,
    "prompts": None,  # a JSONL file (id, class, prompt); default: the shipped suite
    "classes": None,
    "limit": 0,  # prompts per class (0 = all)
    "model": None,  # model.name for the server
    "overrides": [],  # more server overrides, e.g. ["max_batch_size=16", "trace=off"]
    "out": "bench-results",
    "startup_timeout": 600,  # seconds for the server to load the model
}


class Server:
    """``python -m mtpflow.serve`` on a free port; its log in a file; stopped with SIGTERM."""

    def __init__(self, overrides: list[str], log_path: Path, timeout: float):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "mtpflow.serve", "--port", "0", *overrides],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + timeout
        while True:
            m = re.search(r"Uvicorn running on http://([\d.]+):(\d+)", self.log())
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                return
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                tail = "\n".join(self.log().strip().splitlines()[-3:])
                raise UserError(f"the server did not start (log {log_path}):\n{tail}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_bytes().decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def stream_chat(host: str, port: int, model: str, prompt: str, strategy: str, max_tokens: int) -> dict:
    """One streaming chat completion; times measured from sending the request."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                       "mtpflow": {"strategy": strategy}})
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    first, text, tokens, mal = None, [], 0, None
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise UserError(f"the server answered {resp.status}: {resp.read()[:300].decode('utf-8', 'replace')}")
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise UserError(f"a request failed on the server: {chunk['error'].get('message')}")
            for choice in chunk.get("choices") or ():
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            if chunk.get("mtpflow"):
                mal = chunk["mtpflow"].get("mal")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    finally:
        conn.close()
    end = time.perf_counter()
    return {"start": t0, "ttft": (first or end) - t0, "latency": end - t0, "end": end, "tokens": tokens,
            "mal": mal, "text": "".join(text)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run_level(server: Server, model: str, prompts: list[str], strategy: str, concurrency: int, n: int,
              max_tokens: int, progress) -> tuple[dict, list[dict]]:
    jobs = [prompts[i % len(prompts)] for i in range(n)]
    lock = threading.Lock()

    def one(prompt: str) -> dict:
        r = stream_chat(server.host, server.port, model, prompt, strategy, max_tokens)
        with lock:
            progress.update(1)
        return {**r, "prompt": prompt}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in rows)
    mals = [r["mal"] for r in rows if r["mal"] is not None]
    summary = {
        "strategy": strategy, "concurrency": concurrency, "requests": n, "seconds": round(wall, 2),
        "requests_per_s": round(n / wall, 3), "output_tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(1000 * percentile([r["ttft"] for r in rows], 0.5), 1),
        "ttft_p95_ms": round(1000 * percentile([r["ttft"] for r in rows], 0.95), 1),
        "latency_p50_ms": round(1000 * percentile([r["latency"] for r in rows], 0.5), 1),
        "latency_p95_ms": round(1000 * percentile([r["latency"] for r in rows], 0.95), 1),
        "mal": round(sum(mals) / len(mals), 3) if mals else None,
        "output_tokens": tokens,
    }
    return summary, rows


def plot(table, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, (strategy, part) in enumerate(table.groupby("strategy", sort=False)):
        color, x = f"C{i}", part["concurrency"]
        axes[0].plot(x, part["output_tokens_per_s"], marker="o", color=color, label=strategy)
        for ax, name in ((axes[1], "ttft"), (axes[2], "latency")):
            ax.plot(x, part[f"{name}_p95_ms"], marker="o", color=color, label=f"{strategy} p95")
            ax.plot(x, part[f"{name}_p50_ms"], marker=".", linestyle="--", color=color, label=f"{strategy} p50")
    for ax, label in zip(axes, ("output tokens/s", "time to first token (ms)", "request latency (ms)")):
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(table["concurrency"].unique()))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    save_figure(fig, axes, path, title)


def save_figure(fig, axes, path: Path, title: str) -> None:
    """Grid and legend on every panel, the title, then the PNG (and the figure closed)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_options(opts) -> None:
    from omegaconf import ListConfig

    for name in ("strategies", "concurrency", "classes", "overrides"):
        value = opts[name]
        if value is not None and not isinstance(value, ListConfig):
            opts[name] = [value]
    if not opts.strategies:
        raise ConfigError("strategies must name at least one strategy, e.g. strategies=[baseline,mtp]")
    from mtpflow.config import available_strategies

    unknown = [s for s in opts.strategies if s not in available_strategies()]
    if unknown:
        raise UserError(f"unknown strategy {unknown[0]!r}; available: {', '.join(available_strategies())}")
    if not opts.concurrency:
        raise ConfigError("concurrency must list at least one number of clients, e.g. concurrency=[1,4,8,16]")
    for c in opts.concurrency:
        check_int("concurrency", c, 1, 1024)
    check_int("requests", opts.requests, 1)
    check_int("max_new_tokens", opts.max_new_tokens, 1)
    check_int("limit", opts.limit, 0)
    check_int("startup_timeout", opts.startup_timeout, 1)


def write_manifest(out: Path, argv: list[str], opts, overrides: list[str], served_model: str, prompts: int,
                   mode: str = "serve", files: tuple[str, ...] = ("serve_bench.csv", "serve_bench.png"),
                   results: dict | None = None) -> Path:
    """The run's manifest: the server's model, dtype, device and backend as its config composes them (the
    server runs in another process; the trace database's temporary path left out). ``results``: figures the
    mode adds to the settings (the soak's verdicts)."""
    from mtpflow.config import compose
    from mtpflow.backends.execution import resolve_device
    from mtpflow.tools import manifest

    composed = [o for o in overrides if not o.startswith("trace.db=")]
    try:
        cfg = compose(composed)
    except UserError:
        cfg = None
    facts = {**manifest.model_facts(cfg), "id": served_model}
    device = None
    if cfg is not None:
        try:
            device = resolve_device(str(cfg.model.get("device", "auto")))
        except Exception:  # noqa: BLE001 - the manifest records what it can
            device = None
        facts["device"] = None if device is None else str(device)
    settings = {**OmegaConf.to_container(opts, resolve=True), "server_overrides": composed, "prompt_count": prompts}
    record = manifest.collect(mode, argv, model=facts, settings=settings, device=device,
                              extra=None if results is None else {"results": results})
    return manifest.write(out, record, list(files))


def main(argv: list[str]) -> int:
    return run_command("mtpflow.bench", bench_serve, argv)


def server_overrides(opts, *settings: str) -> list[str]:
    """What a server bench passes to ``python -m mtpflow.serve``: its own ``settings``, then ``model.name=`` from
    the ``model`` option (when given) and the user's ``overrides`` (last, so they win)."""
    return [*settings, *(["model.name=" + str(opts.model)] if opts.model else []), *[str(o) for o in opts.overrides]]


def parse_options(argv: list[str], defaults: dict, what: str):
    """``key=value`` arguments over ``defaults``; a malformed or unknown one is a one-line UserError."""
    try:
        opts = OmegaConf.merge(OmegaConf.create(defaults), OmegaConf.from_dotlist(list(argv)))
    except Exception as exc:
        raise UserError(f"bad arguments: {exc}".splitlines()[0]) from None
    unknown = set(opts.keys()) - set(defaults)
    if unknown:
        raise UserError(f"unknown option(s) {what} {', '.join(sorted(unknown))}; known: {', '.join(defaults)}")
    return opts


def bench_serve(argv: list[str]) -> int:
    """The command itself: check the options, start the server, load it level by level, write the results."""
    opts = parse_options(argv, DEFAULTS, "for mode=serve")
    out = Path(str(opts.out)).expanduser()
    server, tmp, done = None, None, False
    try:
        check_options(opts)
        writable_folder(out)
        from mtpflow.tools.specbench import load_prompt_suite

        prompts = [r["prompt"] for r in load_prompt_suite(opts.prompts, opts.classes, int(opts.limit))]
        if not prompts:
            raise UserError("no prompts left after classes= and limit=")
        import pandas as pd
        from tqdm import tqdm

        tmp = Path(tempfile.mkdtemp(prefix="mtpflow-bench-serve-"))
        overrides = server_overrides(opts, f"trace.db={tmp / 'traces.db'}", f"max_batch_size={max(opts.concurrency)}")
        print(f"starting python -m mtpflow.serve {' '.join(overrides)} (log {tmp / 'server.log'})", file=sys.stderr)
        server = Server(overrides, tmp / "server.log", float(opts.startup_timeout))
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.close()
        levels = [int(c) for c in opts.concurrency]
        total = sum(max(int(opts.requests), c) for c in levels) * len(opts.strategies)
        summaries, answers = [], {}
        with tqdm(total=total + len(opts.strategies), unit="req", desc="serve bench") as progress:
            for strategy in opts.strategies:
                stream_chat(server.host, server.port, model, prompts[0], strategy, 8)  # warm-up
                progress.update(1)
                for c in levels:
                    summary, rows = run_level(server, model, prompts, strategy, c, max(int(opts.requests), c),
                                              int(opts.max_new_tokens), progress)
                    first = answers.setdefault(opts.strategies[0], {})
                    same = 0
                    for r in rows:
                        if strategy == opts.strategies[0]:
                            first.setdefault(r["prompt"], r["text"])
                        same += first.get(r["prompt"]) == r["text"]
                    summary["identical"] = f"{same}/{len(rows)}"
                    summaries.append(summary)
        table = pd.DataFrame(summaries)
        print(table.to_string(index=False))
        table.to_csv(out / "serve_bench.csv", index=False)
        plot(table, out / "serve_bench.png",
             f"python -m mtpflow.serve, {model}, {opts.max_new_tokens} new tokens, greedy, "
             f"{len(prompts)} prompts")
        path = write_manifest(out, argv, opts, overrides, model, len(prompts))
        print(f"\nwrote {out / 'serve_bench.csv'}, {out / 'serve_bench.png'} and {path}")
        done = True
        return 0
    finally:
        if server is not None:
            server.stop()
        if done and tmp is not None:  # the server's log and traces stay behind only when something failed
            shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["main", "stream_chat", "run_level", "percentile"]
