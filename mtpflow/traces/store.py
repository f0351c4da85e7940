"""The trace database: runs, steps and per-token events of every decode, in SQLite (WAL mode, busy timeout)
through a typed SQLAlchemy 2 ORM, with a schema version and forward migrations.

Writers take the write lock up front (``BEGIN IMMEDIATE``) so concurrent processes wait in SQLite's busy
handler instead of failing with "database is locked" when a read transaction tries to upgrade.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from sqlalchemy import (
    Boolean, Float, ForeignKey, Index, Integer, String, Text, create_engine, delete, event, func, insert, select,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from mtpflow.errors import UserError

SQLITE_MAGIC = b"SQLite format 3\x00"

RUNNING, COMPLETE, FAILED, INTERRUPTED = "running", "complete", "failed", "interrupted"


class Base(DeclarativeBase):
    pass


class SchemaVersion(Base):
    __tablename__ = "schema_version"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1: a single row
    version: Mapped[int] = mapped_column(Integer)
    migrated_at: Mapped[float] = mapped_column(Float)


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    started_at: Mapped[float] = mapped_column(Float)  # unix seconds
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default=RUNNING)  # running/complete/failed/interrupted
    strategy: Mapped[str] = mapped_column(String(128))
    config: Mapped[str] = mapped_column(Text)  # JSON: the fully resolved config
    model_id: Mapped[str] = mapped_column(String(512))
    prompt: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    package_version: Mapped[str] = mapped_column(String(64))
    stats: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON: RunStats.as_dict() at the end
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)  # schema v2: tells killed runs apart
    hostname: Mapped[str | None] = mapped_column(String(255), nullable=True)  # schema v2
    # the traceback of the internal error a failed run ended on; added to older files when opened (OPTIONAL_COLUMNS)
    error_traceback: Mapped[str | None] = mapped_column(Text, nullable=True)


class Step(Base):
    __tablename__ = "steps"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)  # step index within the run (0-based)
    k: Mapped[int] = mapped_column(Integer)  # K chosen by select_k
    num_proposed: Mapped[int] = mapped_column(Integer)  # draft nodes before pruning
    num_kept: Mapped[int] = mapped_column(Integer)  # draft nodes sent to the verify forward
    accepted_length: Mapped[int] = mapped_column(Integer)  # draft tokens accepted
    num_emitted: Mapped[int] = mapped_column(Integer)  # tokens committed (accepted + recovered/bonus/plain)
    bonus: Mapped[bool] = mapped_column(Boolean)  # a bonus token followed a fully accepted path
    forward_seconds: Mapped[float] = mapped_column(Float)
    step_seconds: Mapped[float] = mapped_column(Float)
    time_since_start: Mapped[float] = mapped_column(Float)  # run start to the end of this step
    stage_seconds: Mapped[str] = mapped_column(Text)  # JSON {stage: seconds}


class TokenEvent(Base):
    __tablename__ = "token_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    # index in the generated output this token occupies (emitted) or would have occupied (draft nodes)
    position: Mapped[int] = mapped_column(Integer)
    node: Mapped[int | None] = mapped_column(Integer, nullable=True)  # draft node index (before pruning)
    depth: Mapped[int | None] = mapped_column(Integer, nullable=True)  # draft depth, 1 = child of the root
    token_id: Mapped[int] = mapped_column(Integer)
    token_text: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # accepted/recovered/bonus/plain/rejected/pruned/deduped/gated
    emitted: Mapped[bool] = mapped_column(Boolean)  # committed to the output
    decided_by: Mapped[str] = mapped_column(String(16))  # prune / gate / dedup / rescore
    draft_prob: Mapped[float | None] = mapped_column(Float, nullable=True)
    target_prob: Mapped[float | None] = mapped_column(Float, nullable=True)
    pfs: Mapped[float | None] = mapped_column(Float, nullable=True)
    gate_score: Mapped[float | None] = mapped_column(Float, nullable=True)
    matches_target: Mapped[bool | None] = mapped_column(Boolean, nullable=True)  # == the target's greedy choice


Index("ix_steps_run_step", Step.run_id, Step.step)
Index("ix_token_events_run", TokenEvent.run_id, TokenEvent.step)
Index("ix_runs_started", Run.started_at)


def _migrate_v1_to_v2(conn: Connection) -> None:
    """v2 records the writer's pid and host, so ``list`` can tell a killed run from one still going."""
    cols = {row[1] for row in conn.exec_driver_sql("PRAGMA table_info(runs)")}
    if "pid" not in cols:
        conn.exec_driver_sql("ALTER TABLE runs ADD COLUMN pid INTEGER")
    if "hostname" not in cols:
        conn.exec_driver_sql("ALTER TABLE runs ADD COLUMN hostname VARCHAR(255)")
    conn.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_runs_started ON runs (started_at)")


# MIGRATIONS[v] upgrades a database at version v to v + 1. A fresh database is created at SCHEMA_VERSION.
MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _migrate_v1_to_v2}
SCHEMA_VERSION = 2

# Nullable columns added without a version bump: a file that lacks one gets it (ALTER TABLE ADD COLUMN) when it
# is opened, and an older mtpflow still reads a file that has it (it selects its own columns by name).
OPTIONAL_COLUMNS = {"runs": {"error_traceback": "TEXT"}}


def _add_optional_columns(conn: Connection) -> None:
    for table, columns in OPTIONAL_COLUMNS.items():
        have = {row[1] for row in conn.exec_driver_sql(f"PRAGMA table_info({table})")}
        for name, kind in columns.items():
            if name not in have:
                conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def default_db_path() -> Path:
    from mtpflow.machine import cache_dir

    return cache_dir() / "traces.db"


def _loads(value: str | None) -> Any:
    return None if value is None else json.loads(value)


def _row(obj: Base) -> dict[str, Any]:
    return {c.key: getattr(obj, c.key) for c in obj.__table__.columns}


class TraceStore:
    """One SQLite trace database. Safe to share between threads and processes (WAL + immediate writes)."""

    def __init__(self, path: str | os.PathLike | None = None, busy_timeout_seconds: float = 30.0):
        self.path = Path(os.path.expanduser(str(path))) if path else default_db_path()
        self.busy_timeout_seconds = float(busy_timeout_seconds)
        # Size the write-ahead log may keep between checkpoints (SQLite's default autocheckpoint is 4 MiB);
        # retention lowers it for small caps. Applied to each pooled connection at its next checkout.
        self.wal_limit_bytes = 4 << 20
        self._write_lock = threading.RLock()
        self._check_path()
        self.engine = self._make_engine()
        self._write_engine = self.engine.execution_options(sqlite_begin="IMMEDIATE")
        try:
            self._open_schema()
        except (DBAPIError, sqlite3.DatabaseError) as exc:
            self.engine.dispose()
            raise UserError(self._explain(exc)) from None

    # ----- opening -------------------------------------------------------------------------------------
    def _check_path(self) -> None:
        p = self.path
        if p.exists() and p.is_dir():
            raise UserError(f"trace database {p} is a directory; pass trace.db=FILE or trace=off")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create the trace directory {p.parent}: {exc.strerror}; "
                            "pass trace.db=PATH or trace=off") from None
        if p.exists() and p.stat().st_size > 0:
            try:
                with open(p, "rb") as f:
                    head = f.read(len(SQLITE_MAGIC))
            except OSError as exc:
                raise UserError(f"cannot read the trace database {p}: {exc.strerror}; "
                                "pass trace.db=PATH or trace=off") from None
            if head != SQLITE_MAGIC:
                raise UserError(f"{p} is not an SQLite trace database; move it away, pass trace.db=PATH "
                                "or trace=off")
        elif not os.access(p.parent, os.W_OK):
            raise UserError(f"cannot write traces in {p.parent} (permission denied); pass trace.db=PATH "
                            "or trace=off")

    def _explain(self, exc: BaseException) -> str:
        msg = str(getattr(exc, "orig", exc) or exc).strip().splitlines()[0]
        if "malformed" in msg or "not a database" in msg or "corrupt" in msg:
            return f"the trace database {self.path} is corrupt ({msg}); move it away, pass trace.db=PATH or trace=off"
        if "readonly" in msg or "unable to open" in msg or "read-only" in msg:
            return f"cannot write the trace database {self.path} ({msg}); pass trace.db=PATH or trace=off"
        return f"trace database {self.path}: {msg}; pass trace.db=PATH or trace=off"

    def _make_engine(self) -> Engine:
        timeout = self.busy_timeout_seconds
        engine = create_engine(
            f"sqlite:///{self.path}",
            connect_args={"timeout": timeout, "check_same_thread": False},
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            # Let SQLAlchemy's "begin" event below issue BEGIN itself (pysqlite's implicit BEGIN is DEFERRED).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            cur.execute("PRAGMA journal_mode = WAL")
            # NORMAL in WAL mode never corrupts the database; a power cut may drop the last commits only.
            cur.execute("PRAGMA synchronous = NORMAL")
            cur.execute("PRAGMA foreign_keys = ON")
            cur.close()

        @event.listens_for(engine, "checkout")
        def _on_checkout(dbapi_conn, record, _proxy):
            limit = int(self.wal_limit_bytes)
            if record.info.get("wal_limit_bytes") != limit:
                cur = dbapi_conn.cursor()
                cur.execute(f"PRAGMA journal_size_limit = {limit}")  # the log file is cut back to this size
                cur.execute(f"PRAGMA wal_autocheckpoint = {max(16, limit // 4096)}")  # pages
                cur.close()
                record.info["wal_limit_bytes"] = limit

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            conn.exec_driver_sql("BEGIN " + conn.get_execution_options().get("sqlite_begin", "DEFERRED"))

        return engine

    def _open_schema(self) -> None:
        with self._write_engine.begin() as conn:
            conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar()  # fails on a non-database
            tables = {r[0] for r in conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type='table'")}
            if "schema_version" not in tables:
                if tables & {"runs", "steps", "token_events"}:
                    raise UserError(f"{self.path} has trace tables but no schema version; move it away or "
                                    "pass trace.db=PATH")
                Base.metadata.create_all(conn)
                conn.execute(insert(SchemaVersion).values(id=1, version=SCHEMA_VERSION, migrated_at=time.time()))
                return
            version = conn.execute(select(SchemaVersion.version).where(SchemaVersion.id == 1)).scalar()
            if version is None:
                raise UserError(f"{self.path}: the schema_version table is empty; move the file away")
            if version > SCHEMA_VERSION:
                raise UserError(f"the trace database {self.path} has schema version {version}, newer than this "
                                f"mtpflow understands ({SCHEMA_VERSION}); upgrade mtpflow or pass trace.db=PATH")
            while version < SCHEMA_VERSION:
                MIGRATIONS[version](conn)
                version += 1
            _add_optional_columns(conn)
            conn.execute(update(SchemaVersion).where(SchemaVersion.id == 1)
                         .values(version=version, migrated_at=time.time()))
            Base.metadata.create_all(conn)  # tables added by later versions (none yet): checkfirst

    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(SchemaVersion.version)).scalar())

    def close(self) -> None:
        self.engine.dispose()

    # ----- writing -------------------------------------------------------------------------------------
    @contextmanager
    def _write(self) -> Iterator[Session]:
        """A write transaction that holds SQLite's write lock from its first statement. This process's writers
        also take turns on a Python lock (SQLite admits one writer at a time anyway), so a checkpoint taken
        under it never waits for a writer of this process."""
        with self._write_lock, Session(self._write_engine) as session, session.begin():
            yield session

    def start_run(self, *, strategy: str, config: dict, model_id: str, prompt: str, prompt_tokens: int,
                  package_version: str, started_at: float | None = None) -> int:
        with self._write() as s:
            run = Run(started_at=started_at or time.time(), status=RUNNING, strategy=strategy,
                      config=json.dumps(config, default=str), model_id=model_id, prompt=prompt,
                      prompt_tokens=prompt_tokens, package_version=package_version, pid=os.getpid(),
                      hostname=socket.gethostname())
            s.add(run)
            s.flush()
            return int(run.id)

    def write_batch(self, steps: list[dict], events: list[dict]) -> None:
        """Insert buffered steps and token events in one transaction (executemany, not a row at a time)."""
        if not steps and not events:
            return
        with self._write() as s:
            if steps:
                s.execute(insert(Step), steps)
            if events:
                s.execute(insert(TokenEvent), events)

    def finish_run(self, run_id: int, status: str, *, output_text: str | None, stats: dict | None,
                   steps: list[dict] = (), events: list[dict] = (), error_traceback: str | None = None) -> None:
        with self._write() as s:
            if steps:
                s.execute(insert(Step), list(steps))
            if events:
                s.execute(insert(TokenEvent), list(events))
            s.execute(update(Run).where(Run.id == run_id).values(
                status=status, finished_at=time.time(), output_text=output_text,
                stats=None if stats is None else json.dumps(stats, default=str), error_traceback=error_traceback))

    # ----- retention (mtpflow.traces.retention decides what to delete) -------------------------------------
    def file_bytes(self) -> int:
        """Bytes on disk: the database file plus its write-ahead log."""
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.path.getsize(f"{self.path}{suffix}")
            except OSError:
                pass
        return total

    def used_bytes(self) -> int:
        """Bytes in live pages. Deleting runs frees pages that later writes reuse, so the file stops growing
        once deletions keep pace, without a VACUUM (which would rewrite the whole file under a write lock)."""
        with self.engine.connect() as conn:
            page_size, pages, free = (conn.exec_driver_sql(f"PRAGMA {p}").scalar()
                                      for p in ("page_size", "page_count", "freelist_count"))
        return int((pages - free) * page_size)

    def finished_run_ids(self, limit: int, started_before: float | None = None) -> list[int]:
        """The oldest runs that are no longer running (a running run is never deleted under its writer)."""
        q = select(Run.id).where(Run.status != RUNNING)
        if started_before is not None:
            q = q.where(Run.started_at < started_before)
        with self.engine.connect() as conn:
            return [int(r) for r in conn.execute(q.order_by(Run.id).limit(int(limit))).scalars()]

    def delete_runs(self, run_ids: list[int]) -> int:
        """Delete runs with their steps and token events, in one transaction (children first, so it does not
        depend on the connection's foreign-key setting)."""
        if not run_ids:
            return 0
        ids = [int(i) for i in run_ids]
        with self._write() as s:
            s.execute(delete(TokenEvent).where(TokenEvent.run_id.in_(ids)))
            s.execute(delete(Step).where(Step.run_id.in_(ids)))
            return int(s.execute(delete(Run).where(Run.id.in_(ids))).rowcount or 0)

    def checkpoint(self, mode: str = "PASSIVE", wait_seconds: float | None = None) -> bool:
        """Copy the write-ahead log into the database. PASSIVE never waits (the next writer restarts the log,
        cut to ``wal_limit_bytes``, once no reader still uses it); TRUNCATE waits for readers and writers, at
        most ``wait_seconds`` (default: the busy timeout), and empties the file. False when the log could not
        be copied whole (it is tried again next time)."""
        if mode not in ("PASSIVE", "FULL", "RESTART", "TRUNCATE"):
            raise ValueError(mode)
        with self._write_lock:
            return self._checkpoint(mode, wait_seconds)

    def _checkpoint(self, mode: str, wait_seconds: float | None) -> bool:
        raw = self.engine.raw_connection()  # outside a transaction: SQLAlchemy would open one first
        cur = raw.cursor()
        try:
            if wait_seconds is not None:
                cur.execute(f"PRAGMA busy_timeout = {int(wait_seconds * 1000)}")
            busy = cur.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()[0]
        finally:
            if wait_seconds is not None:
                cur.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_seconds * 1000)}")
            raw.close()
        return not busy

    # ----- reading (the CLI and the playground) ---------------------------------------------------------
    def list_runs(self, limit: int = 50) -> list[dict]:
        """Most recent runs first: run columns (config and stats parsed) plus ``alive`` for running ones."""
        with Session(self.engine) as s:
            runs = s.scalars(select(Run).order_by(Run.id.desc()).limit(int(limit))).all()
            rows = [self._run_dict(r) for r in runs]
            # runs still "running": fill token counts from what was recorded so far
            open_ids = [r["id"] for r in rows if r["stats"] is None]
            if open_ids:
                counts = dict(s.execute(
                    select(Step.run_id, func.sum(Step.num_emitted)).where(Step.run_id.in_(open_ids))
                    .group_by(Step.run_id)).all())
                for r in rows:
                    if r["id"] in counts:
                        r["recorded_tokens"] = int(counts[r["id"]] or 0)
            return rows

    def get_run(self, run_id: int) -> dict | None:
        with Session(self.engine) as s:
            run = s.get(Run, int(run_id))
            return None if run is None else self._run_dict(run)

    def last_run_id(self) -> int | None:
        with self.engine.connect() as conn:
            return conn.execute(select(func.max(Run.id))).scalar()

    def steps(self, run_id: int) -> list[dict]:
        with Session(self.engine) as s:
            rows = s.scalars(select(Step).where(Step.run_id == int(run_id)).order_by(Step.step)).all()
            out = []
            for r in rows:
                d = _row(r)
                d["stage_seconds"] = _loads(d["stage_seconds"]) or {}
                out.append(d)
            return out

    def token_events(self, run_id: int) -> list[dict]:
        """Every event of a run in step order; within a step, draft nodes by node index, then the next token."""
        with Session(self.engine) as s:
            rows = s.scalars(select(TokenEvent).where(TokenEvent.run_id == int(run_id))
                             .order_by(TokenEvent.step, TokenEvent.id)).all()
            return [_row(r) for r in rows]

    def count(self, table: str, run_id: int | None = None) -> int:
        model = {"runs": Run, "steps": Step, "token_events": TokenEvent}[table]
        q = select(func.count()).select_from(model)
        if run_id is not None:
            q = q.where((model.id if model is Run else model.run_id) == int(run_id))
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar())

    def _run_dict(self, run: Run) -> dict:
        d = _row(run)
        d["config"] = _loads(d["config"]) or {}
        d["stats"] = _loads(d["stats"])
        d["alive"] = self._writer_alive(d) if d["status"] == RUNNING else False
        return d

    @staticmethod
    def _writer_alive(run: dict) -> bool | None:
        """Whether the process recording a running run still exists (None when it ran on another host)."""
        if run.get("pid") is None or run.get("hostname") != socket.gethostname():
            return None
        try:
            os.kill(int(run["pid"]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


__all__ = ["TraceStore", "Run", "Step", "TokenEvent", "SchemaVersion", "SCHEMA_VERSION", "MIGRATIONS",
           "default_db_path", "RUNNING", "COMPLETE", "FAILED", "INTERRUPTED"]
