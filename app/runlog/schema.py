"""The run log's tables, its schema version and the migrations between versions.

The version lives in ``PRAGMA user_version``. Each entry of ``MIGRATIONS`` lifts
the database from the previous version to its own, inside one transaction, so a
database is always at a whole version. A database from a newer kvscope is refused
before anything is written to it.

Times: ``runs.started_at``/``ended_at`` are ISO-8601 UTC text (readable in
Datasette); the per-step and per-request times are the engine's ``time.time()``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import sqlite_utils
from sqlite_utils.db import ForeignKey

SCHEMA_VERSION = 5
RUN_TABLES = ("runs", "requests", "steps", "events", "snapshots")
BUSY_TIMEOUT_S = 1.0
# How SQLite says it could not create the WAL index of a read-only connection.
_NO_WAL_INDEX = ("readonly", "unable to open")


class SchemaError(Exception):
    """The file is a database kvscope must not touch: from a newer kvscope, or not a run log."""


# The steps table, as each version made it. Most columns are StepStats fields of the same name, which the
# writer copies as they are (records.py derives that list from STEP_COLUMNS rather than naming them again).
_STEPS_V1 = {
    "run_id": int, "step": int, "time": float, "duration": float, "forward_duration": float,
    "num_prefill_tokens": int, "num_decode_tokens": int, "num_generated_tokens": int,
    "num_running": int, "num_waiting": int, "num_swapped": int,
    "num_free_blocks": int, "num_cached_free_blocks": int, "num_used_blocks": int,
    "num_total_blocks": int, "kv_usage": float, "kv_token_utilisation": float,
    "prefix_cache_queries": int, "prefix_cache_hits": int, "num_preemptions": int,
    "num_swapped_out_blocks": int, "num_swapped_in_blocks": int,
    "prompt_tokens_per_s": float, "generation_tokens_per_s": float,
    "num_host_blocks": int, "num_free_host_blocks": int,
}
_STEPS_V3 = ("num_copy_on_write_blocks", "num_evicted_blocks")
# Per KV-cache group counters (StepStats' tuples), as JSON lists; NULL for a run with one group.
GROUP_COLUMNS = ("group_held_blocks", "window_freed_blocks", "window_freed_step")
STEP_COLUMNS = (*_STEPS_V1, *_STEPS_V3, *GROUP_COLUMNS)   # the steps table at SCHEMA_VERSION


def _owned_by_run(table: str) -> list[ForeignKey]:
    # Rows of every child table go with their run: `kvscope runs rm` is one DELETE.
    return [ForeignKey(table, "run_id", "runs", "id", on_delete="CASCADE")]


def _create_v1(db: sqlite_utils.Database) -> None:
    db["runs"].create(
        {
            "id": int, "started_at": str, "ended_at": str, "status": str, "source": str,
            "kvscope_version": str, "model": str, "device": str, "dtype": str,
            "block_size": int, "num_blocks": int, "config": str,
            "pid": int, "pid_started_at": float, "hostname": str, "num_dropped_records": int,
        },
        pk="id",
        not_null=["started_at", "status", "source"],
        defaults={"status": "running", "num_dropped_records": 0},
    )
    db["requests"].create(
        {
            "run_id": int, "request_id": str, "prompt_text": str, "num_prompt_tokens": int, "n": int,
            "output_text": str, "num_output_tokens": int, "sample_texts": str,
            "arrival_time": float, "first_token_time": float, "finish_time": float,
            "finish_reason": str, "num_cached_tokens": int, "num_preemptions": int, "error": str,
        },
        pk=("run_id", "request_id"),
        foreign_keys=_owned_by_run("requests"),
    )
    db["steps"].create(_STEPS_V1, pk=("run_id", "step"), foreign_keys=_owned_by_run("steps"))
    db["events"].create(
        {"id": int, "run_id": int, "step": int, "kind": str, "request_id": str, "blocks": str, "detail": str},
        pk="id",
        foreign_keys=_owned_by_run("events"),
        not_null=["run_id", "step", "kind"],
    )
    db["events"].create_index(["run_id", "step"])
    db["snapshots"].create(
        {"run_id": int, "step": int, "keyframe": int, "data": bytes},
        pk=("run_id", "step"),
        foreign_keys=_owned_by_run("snapshots"),
        not_null=["keyframe", "data"],
    )
    # One row per run with the figures `kvscope runs` lists; handy in Datasette too.
    db.create_view("run_summary", RUN_SUMMARY)


# The listing view as version 1 made it; version 4 adds the run's label to it.
RUN_SUMMARY = """
        SELECT runs.id, runs.started_at, runs.ended_at, runs.status, runs.source, runs.model,
               runs.device, runs.dtype, runs.pid, runs.hostname, runs.pid_started_at,
               coalesce(r.num_requests, 0) AS num_requests, r.num_output_tokens,
               s.num_steps, s.num_generated_tokens, s.busy_seconds,
               CASE WHEN s.busy_seconds > 0 THEN s.num_generated_tokens / s.busy_seconds END
                   AS mean_tokens_per_s
        FROM runs LEFT JOIN (
            SELECT run_id, count(*) AS num_steps, sum(num_generated_tokens) AS num_generated_tokens,
                   sum(duration) AS busy_seconds
            FROM steps GROUP BY run_id
        ) s ON s.run_id = runs.id
        LEFT JOIN (
            SELECT run_id, count(*) AS num_requests, sum(num_output_tokens) AS num_output_tokens
            FROM requests GROUP BY run_id
        ) r ON r.run_id = runs.id
"""


def _add_status_detail(db: sqlite_utils.Database) -> None:
    # Why a run ended as it did: the reason its log is incomplete, what interrupted it.
    db["runs"].add_column("status_detail", str)


def _add_copy_and_eviction_counters(db: sqlite_utils.Database) -> None:
    # The steps' cumulative copy-on-write and eviction counters (StepStats gained them); 0 for older steps.
    for column in _STEPS_V3:
        db.execute(f"ALTER TABLE steps ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")


def _add_label(db: sqlite_utils.Database) -> None:
    # What started the run, within its source: the lesson a "lesson" run belongs to. The listing view shows it.
    db["runs"].add_column("label", str)
    db.execute("DROP VIEW run_summary")
    db.create_view("run_summary", RUN_SUMMARY.replace("runs.source,", "runs.source, runs.label,"))


def _add_group_counters(db: sqlite_utils.Database) -> None:
    # A hybrid KV cache's counters per group; NULL for older steps and for one-group runs, read back as none.
    for column in GROUP_COLUMNS:
        db["steps"].add_column(column, str)


# MIGRATIONS[v] lifts a database at version v - 1 to version v.
MIGRATIONS: dict[int, Callable[[sqlite_utils.Database], None]] = {
    1: _create_v1, 2: _add_status_detail, 3: _add_copy_and_eviction_counters, 4: _add_label,
    5: _add_group_counters}


def connect(path: str, *, read_only: bool = False, timeout: float = BUSY_TIMEOUT_S) -> sqlite_utils.Database:
    """A connection the writer thread may use after the opening thread (check_same_thread off)."""
    if read_only:
        conn = _connect_read_only(path, timeout)
    else:
        conn = sqlite3.connect(path, timeout=timeout, check_same_thread=False)
    db = sqlite_utils.Database(conn, execute_plugins=False)
    db.execute("PRAGMA foreign_keys = ON")
    return db


def _connect_read_only(path: str, timeout: float) -> sqlite3.Connection:
    """mode=ro, which reads what a live writer has in its WAL. A WAL database whose writer has closed
    cannot be opened so where SQLite may not create the WAL index beside it (a read-only mount or
    directory); there nothing is writing, and immutable=1 reads the file as it is."""
    uri = Path(path).resolve().as_uri()  # as_uri escapes '?' and '#' in the path
    conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=timeout, check_same_thread=False)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError as exc:
        conn.close()
        if not any(words in str(exc) for words in _NO_WAL_INDEX):
            raise
    conn = sqlite3.connect(f"{uri}?immutable=1", uri=True, timeout=timeout, check_same_thread=False)
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()   # any other trouble raises here
    return conn


def schema_version(db: sqlite_utils.Database) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def check_readable(db: sqlite_utils.Database, path: str) -> int:
    """The database's version; raise SchemaError if this kvscope cannot read it."""
    version = schema_version(db)
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{path} was written by a newer kvscope (schema version {version}, this one reads up to "
            f"{SCHEMA_VERSION}); upgrade kvscope or pass --db with another file"
        )
    if version == 0 and db.table_names():
        raise SchemaError(f"{path} is an SQLite database but not a kvscope run log; "
                          "pass --db with another file")
    return version


def prepare(db: sqlite_utils.Database, path: str) -> None:
    """Refuse foreign or newer databases, then switch to WAL and migrate up to SCHEMA_VERSION."""
    version = check_readable(db, path)
    # WAL: readers (Datasette, `kvscope runs`) never block the writer, and a killed
    # writer leaves committed transactions intact. NORMAL sync is durable against
    # process crashes, which is what we need; only power loss can drop the last commits.
    db.enable_wal()
    db.execute("PRAGMA synchronous = NORMAL")
    for target in range(version + 1, SCHEMA_VERSION + 1):
        _migrate(db, target)


def _migrate(db: sqlite_utils.Database, target: int) -> None:
    # IMMEDIATE takes the write lock first: two processes opening a fresh file at
    # once must not both create the tables. The loser sees the new version and skips.
    db.execute("BEGIN IMMEDIATE")
    try:
        if schema_version(db) < target:
            MIGRATIONS[target](db)
            db.execute(f"PRAGMA user_version = {target}")
        db.execute("COMMIT")
    except BaseException:
        db.conn.rollback()
        raise
