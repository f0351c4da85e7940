"""The server process under load: SIGTERM drains (running and waiting requests finish, new ones are refused, no
run is left ``running``, the trace database passes ``PRAGMA integrity_check``), and 500 requests with a
retention cap keep the database under its cap while ``/metrics`` still counts every request."""
from __future__ import annotations

import re
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_process import REPO, ServerProcess, client, save_tiny_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def db_bytes(db) -> int:
    """The database file plus its write-ahead log (a file can vanish between exists() and stat())."""
    total = 0
    for p in (db, db.with_name(db.name + "-wal")):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def readme_client_example_works_as_written(url: str) -> None:
    """The README's ``openai`` example, run as written but for the port (no API key on this server)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Server"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "http://127.0.0.1:8000/v1" in code and len(code.strip().splitlines()) <= 8
    scope: dict = {}
    exec(code.replace("http://127.0.0.1:8000/v1", f"{url}/v1"), scope)  # noqa: S102 - the page's own code
    assert scope["reply"].choices[0].message.content


def test_sigterm_drains_running_and_waiting_requests(tiny_folder, tmp_path):
    db = tmp_path / "traces.db"
    # a drain timeout far beyond this load's needs, even on a busy machine: the point is the drain
    with ServerProcess(tmp_path / "server.log", "--drain-timeout", "600", f"model.name={tiny_folder}",
                       f"trace.db={db}", "trace.sample=1.0", "max_batch_size=4", "strategy=pld") as srv:
        readme_client_example_works_as_written(srv.url)
        n, tokens = 10, 40
        results, errors = {}, []

        def request(i: int):
            try:
                text, reason = "", None
                for chunk in client(srv.url).completions.create(model=str(tiny_folder), prompt=f"request {i}",
                                                                max_tokens=tokens, stream=True,
                                                                stream_options={"include_usage": True}):
                    if chunk.choices:
                        text += chunk.choices[0].text
                        reason = chunk.choices[0].finish_reason or reason
                    elif chunk.usage:
                        results[i] = (reason, chunk.usage.completion_tokens)
            except Exception as exc:  # collected: a thread's exception would be lost
                errors.append(repr(exc))

        threads = [threading.Thread(target=request, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        deadline = time.time() + 120
        while True:  # every request is in the engine: 4 running, 6 waiting
            health = httpx.get(srv.url + "/health", timeout=30).json()
            if health["running"] + health["waiting"] == n:
                break
            assert time.time() < deadline, health
            time.sleep(0.05)
        srv.terminate()
        time.sleep(0.3)
        with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
            client(srv.url).completions.create(model=str(tiny_folder), prompt="too late", max_tokens=4)
        for t in threads:
            t.join(timeout=600)
        assert srv.proc.wait(timeout=120) == 0, srv.log()[-3000:]
        assert not errors
        assert results == {i: ("length", tokens) for i in range(n)}  # all drained, none cut
        con = sqlite3.connect(db)
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        statuses = dict(con.execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall())
        assert statuses == {"complete": n + 1}  # and the README example's
        assert "Traceback" not in srv.log()


def test_sigterm_past_the_drain_timeout_cancels_and_records_interrupted(tiny_folder, tmp_path):
    db = tmp_path / "traces.db"
    # the drain timeout must be a small fraction of the time 900 tokens take on the fastest host CI may get:
    # a stream that ends inside it is recorded complete, and the test would no longer cut one
    with ServerProcess(tmp_path / "server.log", "--drain-timeout", "0.2", f"model.name={tiny_folder}",
                       f"trace.db={db}", "trace.sample=1.0", "max_batch_size=2") as srv:
        streaming = threading.Semaphore(0)
        outcomes = []

        def request(i: int):
            try:
                stream = client(srv.url).completions.create(model=str(tiny_folder), prompt=f"long {i}",
                                                             max_tokens=900, stream=True)
                for j, _ in enumerate(stream):
                    if j == 0:
                        streaming.release()
                outcomes.append("finished")
            except openai.APIError as exc:  # the server ended the stream with an error event
                outcomes.append(str(exc))

        threads = [threading.Thread(target=request, args=(i,)) for i in range(3)]  # 2 running, 1 waiting
        for t in threads:
            t.start()
        for _ in range(2):
            assert streaming.acquire(timeout=120)
        srv.terminate()
        for t in threads:
            t.join(timeout=120)
        assert srv.proc.wait(timeout=120) == 0, srv.log()[-3000:]
        # 900 tokens take far longer than 0.2 s: every client is told the server shut down; the two streaming
        # by an error event, the waiting one (no status line yet: it waits for its first token) by a 503
        said = "the server shut down before this request finished"
        assert sorted(outcomes) == sorted([said, said, f"Error code: 503 - {said}"])
        con = sqlite3.connect(db)
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        statuses = [row[0] for row in con.execute("SELECT status FROM runs")]
        # the waiting request never started a run; the running ones were cancelled and say so
        assert statuses == ["interrupted", "interrupted"]
        assert "Traceback" not in srv.log()


def test_retention_cap_holds_under_500_requests(tiny_folder, tmp_path):
    db, cap_mb, n = tmp_path / "traces.db", 1.0, 500
    sizes, done = [], threading.Event()

    def watch():
        while not done.is_set():
            sizes.append(db_bytes(db))
            time.sleep(0.1)

    with ServerProcess(tmp_path / "server.log", f"model.name={tiny_folder}", f"trace.db={db}", "trace.sample=1.0",
                       f"trace.retention.max_mb={cap_mb}", "strategy=pld") as srv:

        def request(i: int) -> int:
            body = {"model": str(tiny_folder), "prompt": f"load {i}", "max_tokens": 8, "stream": i % 2 == 0}
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=300).status_code

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.time()
        try:
            with ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(request, range(n)))
        finally:
            done.set()
            watcher.join()
        elapsed = time.time() - started
        assert codes == [200] * n
        metrics = httpx.get(srv.url + "/metrics", timeout=60).text
        complete = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("mtpflow_server_requests_total{") and 'outcome="complete"' in line)
        assert complete == n  # the server's counters count every request, deleted runs included
        e2e = next(line for line in metrics.splitlines()
                   if line.startswith("mtpflow_server_e2e_request_latency_seconds_count"))
        assert float(e2e.split()[-1]) == n
        assert srv.stop() == 0
    cap = cap_mb * (1 << 20)
    print(f"\n{n} requests in {elapsed:.1f} s; trace database peak {max(sizes) / 1024:.0f} kB, cap {cap / 1024:.0f} kB")
    assert max(sizes + [db_bytes(db)]) <= cap
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    kept = con.execute("SELECT count(*) FROM runs").fetchone()[0]
    assert 0 < kept < n  # the oldest were deleted
    assert con.execute("SELECT count(*) FROM runs WHERE status = 'running'").fetchone()[0] == 0
    # what is left is whole: no step or token event outlives its run
    for table in ("steps", "token_events"):
        orphans = con.execute(f"SELECT count(*) FROM {table} WHERE run_id NOT IN (SELECT id FROM runs)").fetchone()
        assert orphans == (0,)
