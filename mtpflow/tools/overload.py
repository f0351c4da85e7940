"""The overload check of the server (issue 48): ``python -m mtpflow.tools.overload`` starts ``python -m
mtpflow.serve`` (the default model unless ``model=``) with ``engine.max_waiting=4``, sends ``clients`` (32) chat
completions through the official ``openai`` client at the same instant (half streamed), and reports how each
ended: answered (200) with its latency, refused (429: ``Retry-After``, an error object, seconds from sending to
the refusal) or anything else (a client timeout, another status); then what ``/metrics`` counted.

    python -m mtpflow.tools.overload clients=32 max_waiting=4 max_tokens=64

Prints one JSON object; exits 1 when the must-hold fails (an outcome other than 200/429, a refusal slower than
1 s or without ``Retry-After`` and an error object, ``/metrics`` not counting both)."""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from mtpflow.errors import check_int, run_command
from mtpflow.tools.bench_serve import Server, parse_options, percentile, server_overrides

DEFAULTS = {"clients": 32, "max_waiting": 4, "max_tokens": 64, "model": None, "overrides": [],
            "client_timeout": 600, "startup_timeout": 600}
ERROR_FIELDS = {"message", "type", "param", "code"}


def requests_total(url: str) -> dict[str, float]:
    """``mtpflow_server_requests_total`` by outcome (all endpoints), from ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "mtpflow_server_requests_total":
                outcome = sample.labels["outcome"]
                counts[outcome] = counts.get(outcome, 0) + sample.value
    return counts


def overload(argv: list[str]) -> int:
    report = measure(argv)
    print(json.dumps(report, indent=2))
    return 0 if report["must_hold"] else 1


def measure(argv: list[str]) -> dict:
    """Start the server, send every client's request at once, stop it; the report (``must_hold`` included)."""
    opts = parse_options(argv, DEFAULTS, "of mtpflow.tools.overload")
    clients = check_int("clients", opts.clients, 1, 1024)
    import openai

    tmp = Path(tempfile.mkdtemp(prefix="mtpflow-overload-"))
    waiting = check_int("max_waiting", opts.max_waiting, 0)
    overrides = server_overrides(opts, "trace=off", f"engine.max_waiting={waiting}")
    server = Server(overrides, tmp / "server.log", float(opts.startup_timeout))
    url = f"http://{server.host}:{server.port}"
    try:
        make = lambda: openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,  # noqa: E731
                                     timeout=float(opts.client_timeout))
        model = make().models.list().data[0].id
        make().chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        before = requests_total(url)
        outcomes: list[dict] = []
        go = threading.Barrier(clients)

        def one(i: int) -> None:
            c = make()
            messages = [{"role": "user", "content": f"Client {i}: write a short story about a lighthouse."}]
            go.wait(60)
            t0 = time.perf_counter()
            row = {"client": i, "stream": bool(i % 2)}
            try:
                if i % 2:
                    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                        model=model, messages=messages, max_tokens=int(opts.max_tokens), stream=True) if ch.choices)
                else:
                    text = c.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=int(opts.max_tokens)).choices[0].message.content
                row.update(status=200, chars=len(text or ""))
            except openai.RateLimitError as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                row.update(status=429, retry_after=exc.response.headers.get("retry-after"),
                           error_object=set(body) == ERROR_FIELDS and bool(body.get("message")), code=body.get("code"))
            except Exception as exc:  # noqa: BLE001 - a client timeout or anything else is reported
                row.update(status=type(exc).__name__, error=str(exc)[:200])
            row["seconds"] = time.perf_counter() - t0
            outcomes.append(row)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = requests_total(url)
    finally:
        server.stop()
    answered = [o for o in outcomes if o["status"] == 200]
    refused = [o for o in outcomes if o["status"] == 429]
    counted = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    report = {
        "clients": clients, "server_overrides": overrides, "model": model,
        "answered": len(answered), "refused": len(refused), "other": [o for o in outcomes if o["status"] not in (200, 429)],
        "answered_latency_s": {"min": round(min((o["seconds"] for o in answered), default=float("nan")), 2),
                               "p50": round(percentile([o["seconds"] for o in answered], 0.5), 2),
                               "max": round(max((o["seconds"] for o in answered), default=float("nan")), 2)},
        "refused_after_s": {"p50": round(percentile([o["seconds"] for o in refused], 0.5), 3),
                            "max": round(max((o["seconds"] for o in refused), default=float("nan")), 3)},
        "refused_with_retry_after_and_error_object": sum(o["retry_after"] is not None and o["error_object"]
                                                         for o in refused),
        "refusal_codes": sorted({str(o["code"]) for o in refused}),
        "retry_after": sorted({str(o["retry_after"]) for o in refused}),
        "metrics_counted": counted,
    }
    holds = (not report["other"] and all(o["seconds"] < 1.0 for o in refused)
             and report["refused_with_retry_after_and_error_object"] == len(refused)
             and counted.get("complete") == len(answered) and counted.get("queue_full") == len(refused))
    report["must_hold"] = holds
    shutil.rmtree(tmp, ignore_errors=True)
    return report


def main(argv=None) -> int:
    return run_command("mtpflow.tools.overload", overload, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
