"""The trace store on its own: the read API, forward migrations, and one clear error line for a corrupt file,
a non-SQLite file or a folder that cannot be written."""
from __future__ import annotations

import os
import sqlite3

import pytest

from mtpflow.errors import UserError
from mtpflow.traces.store import SCHEMA_VERSION, TraceStore


def add_run(store, n_steps=3, strategy="pld"):
    run_id = store.start_run(strategy=strategy, config={"k": 4}, model_id="m", prompt="p", prompt_tokens=2,
                             package_version="0")
    steps = [dict(run_id=run_id, step=i, k=4, num_proposed=4, num_kept=3, accepted_length=2, num_emitted=3,
                  bonus=False, forward_seconds=0.1, step_seconds=0.12, time_since_start=0.2 + 0.12 * i,
                  stage_seconds='{"verify": 0.1}') for i in range(n_steps)]
    events = [dict(run_id=run_id, step=i, position=3 * i + j, node=j, depth=j + 1, token_id=10 + j,
                   token_text=f"t{j}", status="accepted", emitted=True, decided_by="gate")
              for i in range(n_steps) for j in range(3)]
    store.write_batch(steps, events)
    return run_id


def test_read_api_round_trip(tmp_path):
    store = TraceStore(tmp_path / "t.db")
    a = add_run(store)
    b = add_run(store, strategy="jacobi")
    store.finish_run(a, "complete", output_text="out", stats={"mal": 3.0, "new_tokens": 9})
    runs = store.list_runs()
    assert [r["id"] for r in runs] == [b, a]  # most recent first
    assert runs[1]["stats"] == {"mal": 3.0, "new_tokens": 9} and runs[1]["config"] == {"k": 4}
    assert runs[0]["status"] == "running" and runs[0]["recorded_tokens"] == 9 and runs[0]["alive"] is True
    assert store.get_run(a)["output_text"] == "out" and store.get_run(12345) is None
    assert [s["step"] for s in store.steps(a)] == [0, 1, 2] and store.steps(a)[0]["stage_seconds"] == {"verify": 0.1}
    assert len(store.token_events(a)) == 9
    assert store.list_runs(limit=1)[0]["id"] == b
    con = sqlite3.connect(tmp_path / "t.db")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


V1_SCHEMA = """
CREATE TABLE schema_version (id INTEGER PRIMARY KEY, version INTEGER, migrated_at FLOAT);
INSERT INTO schema_version VALUES (1, 1, 0);
CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, started_at FLOAT, finished_at FLOAT, status VARCHAR(16),
  strategy VARCHAR(128), config TEXT, model_id VARCHAR(512), prompt TEXT, prompt_tokens INTEGER, output_text TEXT,
  package_version VARCHAR(64), stats TEXT);
CREATE TABLE steps (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id INTEGER REFERENCES runs(id) ON DELETE CASCADE,
  step INTEGER, k INTEGER, num_proposed INTEGER, num_kept INTEGER, accepted_length INTEGER, num_emitted INTEGER,
  bonus BOOLEAN, forward_seconds FLOAT, step_seconds FLOAT, time_since_start FLOAT, stage_seconds TEXT);
CREATE TABLE token_events (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id INTEGER REFERENCES runs(id) ON DELETE CASCADE,
  step INTEGER, position INTEGER, node INTEGER, depth INTEGER, token_id INTEGER, token_text TEXT, status VARCHAR(16),
  emitted BOOLEAN, decided_by VARCHAR(16), draft_prob FLOAT, target_prob FLOAT, pfs FLOAT, gate_score FLOAT,
  matches_target BOOLEAN);
INSERT INTO runs VALUES (1, 1.0, 2.0, 'complete', 'pld', '{}', 'm', 'old prompt', 3, 'old output', '0.0', '{"mal": 2}');
INSERT INTO token_events VALUES (1, 1, 0, 0, NULL, NULL, 7, 'x', 'plain', 1, 'prefill', NULL, NULL, NULL, NULL, NULL);
"""


def test_forward_migration_keeps_old_runs(tmp_path):
    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    con.executescript(V1_SCHEMA)
    con.close()
    store = TraceStore(path)
    assert store.schema_version() == SCHEMA_VERSION == 2
    old = store.get_run(1)
    assert old["output_text"] == "old output" and old["pid"] is None and old["status"] == "complete"
    assert len(store.token_events(1)) == 1
    new = add_run(store)  # the v2 columns are written
    assert store.get_run(new)["pid"] == os.getpid()
    store.close()
    assert TraceStore(path).schema_version() == SCHEMA_VERSION  # reopening is a no-op


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "future.db"
    TraceStore(path).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE schema_version SET version = 99")
    con.commit()
    con.close()
    with pytest.raises(UserError, match="schema version 99, newer"):
        TraceStore(path)


def test_not_sqlite_file_is_one_clear_error(tmp_path):
    path = tmp_path / "traces.db"
    path.write_text("this is a text file, not a database\n" * 10)
    with pytest.raises(UserError, match="not an SQLite trace database") as info:
        TraceStore(path)
    assert "\n" not in str(info.value) and "trace=off" in str(info.value)
    assert path.read_text().startswith("this is a text file")  # never overwritten


def test_corrupt_sqlite_file_is_one_clear_error(tmp_path):
    path = tmp_path / "traces.db"
    store = TraceStore(path)
    add_run(store)
    store.close()
    data = bytearray(path.read_bytes())
    data[16:4096] = b"\xff" * (4096 - 16)  # keep the magic header, destroy the page size and the schema page
    path.write_bytes(bytes(data))
    for wal in (path.with_name("traces.db-wal"), path.with_name("traces.db-shm")):
        wal.unlink(missing_ok=True)
    with pytest.raises(UserError, match="corrupt|trace database") as info:
        TraceStore(path)
    assert "\n" not in str(info.value)


def test_unwritable_folder_is_one_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot create the trace directory"):
        TraceStore(blocker / "sub" / "traces.db")  # its parent would have to be inside a file


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only folders")
def test_read_only_folder_is_one_clear_error(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(UserError, match="permission denied"):
            TraceStore(folder / "traces.db")
    finally:
        folder.chmod(0o700)


def test_directory_at_the_path_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        TraceStore(tmp_path)
