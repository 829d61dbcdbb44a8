"""RunLogger: the engine-facing end of the run log.

The engine thread only enqueues records (never waits on disk). One daemon
thread drains the queue, turns records into rows and inserts them in batches,
each batch one ``db.atomic()`` transaction, at least every FLUSH_INTERVAL_S.

A batch that fails (a full disk, a file removed under it) ends the logging but
never the run: the logger stops taking records, says so once through
``on_failure``, and marks the run "incomplete" with the reason, so nobody
mistakes a log that stopped at step 1 for a short run or a crash.

How a run ended (``runs.status``): finished; interrupted (it ended with requests
unfinished); crashed (an exception ended it, or its process died); incomplete
(the log stopped before the run did). ``runs.status_detail`` says why.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import sqlite_utils

from kvscope.app.runlog.records import LoggedStep, RequestAdded, RowBuilder, Rows, record_bytes
from kvscope.engine.observer import EngineObserver
from kvscope.engine.outputs import StepResult

FLUSH_INTERVAL_S = 0.1
MAX_BATCH_RECORDS = 512
# A bound on memory if the disk stalls: beyond it, records are counted and dropped
# rather than making the engine wait. Snapshot deltas survive drops (see snapshots.py).
MAX_QUEUED_RECORDS = 8192
MAX_QUEUED_BYTES = 256 * 2 ** 20    # and by what they hold (records.record_bytes): a big pool's steps are bigger
# The writer may wait longer than the opener for another writer (two apps, one file).
WRITER_BUSY_TIMEOUT_MS = 5000
CLOSE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class _Close:
    status: str
    detail: str | None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class RunLogger(EngineObserver):
    """Records one run, as an observer of the engine. Disabled loggers (``enabled`` False) accept every call
    and do nothing."""

    def __init__(self, path: Path | None, *, db: sqlite_utils.Database | None = None,
                 run_id: int | None = None, warning: str | None = None,
                 on_failure: Callable[[str], None] | None = None, keep_empty: bool = True):
        self.path = path
        self.run_id = run_id
        self.detach: Callable[[], None] = lambda: None     # record_run sets it: stops hearing the engine
        self.warning = warning
        self.num_dropped_records = 0
        self.on_failure = on_failure    # called once, from the writer thread, if the log stops writing
        # False: a run in which nothing was asked (an engine the app built, then replaced before any request)
        # leaves no row behind, so starting lessons does not fill the log with empty runs.
        self.keep_empty = keep_empty
        self._db = db
        self._failed = False
        self.failure: str | None = None     # why the log stopped writing, once it has
        self._num_written_steps = 0
        self._closed = db is None
        self._close_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUED_RECORDS)
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if db is not None:
            db.execute(f"PRAGMA busy_timeout = {WRITER_BUSY_TIMEOUT_MS}")
            self._thread = threading.Thread(target=self._drain, name=f"kvscope-runlog-{run_id}", daemon=True)
            self._thread.start()
            atexit.register(self._close_at_exit)

    @classmethod
    def disabled(cls, path: Path | None, warning: str | None = None) -> RunLogger:
        return cls(path, warning=warning)

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        # Ctrl-C is the user ending the run; anything else escaping the block ended it abnormally.
        self.close(*_ending(exc))

    def _close_at_exit(self) -> None:
        # The interpreter sets sys.last_value when it reports an uncaught exception, before atexit.
        self.close(*_ending(getattr(sys, "last_value", None)))

    @property
    def writer(self) -> threading.Thread | None:
        """The thread that writes the records (None for a disabled logger): `kvscope bench ui` times it."""
        return self._thread

    @property
    def enabled(self) -> bool:
        return self._db is not None and not self._failed

    def request_added(self, request_id: str, prompt_text: str, num_prompt_tokens: int, n: int) -> None:
        self._put(RequestAdded(request_id, prompt_text, num_prompt_tokens, n))

    def step(self, result: StepResult) -> None:
        if not (self._closed or self._failed):
            self._put(LoggedStep.of(result))

    def _put(self, record: RequestAdded | LoggedStep) -> None:
        if self._closed or self._failed:
            return
        size = record_bytes(record)
        with self._bytes_lock:
            if self._queued_bytes + size > MAX_QUEUED_BYTES:
                self.num_dropped_records += 1
                return
            self._queued_bytes += size
        try:
            self._queue.put_nowait((record, size))
        except queue.Full:
            with self._bytes_lock:
                self._queued_bytes -= size
            self.num_dropped_records += 1

    def close(self, status: str = "finished", detail: str | None = None) -> None:
        """Flush what is queued and mark the run ended, ``detail`` saying why when it is not plainly
        finished. "finished" with requests still unfinished is recorded as "interrupted". Idempotent;
        also runs at interpreter exit."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._close_at_exit)
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_Close(status, detail))
            self._thread.join(CLOSE_TIMEOUT_S)

    # --- writer thread -------------------------------------------------------------

    def _take(self, timeout: float | None = None):
        """The next record (or _Close), no longer counted against MAX_QUEUED_BYTES."""
        item = self._queue.get(timeout=timeout)
        if isinstance(item, _Close):
            return item
        record, size = item
        with self._bytes_lock:
            self._queued_bytes -= size
        return record

    def _drain(self) -> None:
        rows_for = RowBuilder(self.run_id)
        closing = None
        while closing is None:
            batch = [self._take()]
            deadline = time.monotonic() + FLUSH_INTERVAL_S
            while len(batch) < MAX_BATCH_RECORDS and not isinstance(batch[-1], _Close):
                try:
                    batch.append(self._take(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            if isinstance(batch[-1], _Close):
                closing = batch.pop()
            if not self._failed:
                self._write_batch(rows_for, batch)
        if rows_for.empty and not self.keep_empty and not self._failed and not self.num_dropped_records:
            self._remove_run()
        else:
            self._set_status(*self._final_status(closing, rows_for), ended=True)
        try:
            self._db.close()
        except Exception:
            pass

    def _write_batch(self, rows_for: RowBuilder, batch: list) -> None:
        try:
            self._write(rows_for, batch)
        except Exception as exc:  # whatever breaks the log must not reach the engine
            self._failed = True
            self.failure = f"the log stopped after {self._num_written_steps} steps: {exc}"
            self.warning = f"run log stopped writing to {self.path}: {self.failure}; the run continues without it"
            self._set_status("incomplete", self.failure)
            if self.on_failure is not None:
                try:
                    self.on_failure(self.warning)
                except Exception:
                    pass    # a broken callback must not end the writer before it closes the run

    def _final_status(self, closing: _Close, rows_for: RowBuilder) -> tuple[str, str | None]:
        status, detail = closing.status, closing.detail
        if self._failed:
            ended = "" if status == "finished" else f"; the run then ended {status}"
            return "incomplete", self.failure + ended
        if status == "finished" and rows_for.unfinished:
            return "interrupted", f"{len(rows_for.unfinished)} request(s) unfinished when the run ended"
        return status, detail

    def _write(self, rows_for: RowBuilder, batch: list) -> None:
        rows = Rows()
        for record in batch:
            rows_for.add(rows, record)
        db = self._db
        with db.atomic():
            if rows.run_update:
                db["runs"].update(self.run_id, rows.run_update)
            _insert(db, "requests", rows.added_requests, upsert_on=("run_id", "request_id"))
            # OR REPLACE: an engine restarting its step count must not turn the log off.
            _insert(db, "steps", rows.steps, verb="INSERT OR REPLACE")
            _insert(db, "events", rows.events)
            _insert(db, "snapshots", rows.snapshots, verb="INSERT OR REPLACE")
            _insert(db, "requests", rows.finished_requests, upsert_on=("run_id", "request_id"))
        self._num_written_steps += len(rows.steps)

    def _remove_run(self) -> None:
        try:
            with self._db.atomic():
                self._db.execute("DELETE FROM runs WHERE id = ?", [self.run_id])   # nothing else refers to it
        except Exception:
            self._set_status("finished", None, ended=True)    # kept after all: an empty run is no harm

    def _set_status(self, status: str, detail: str | None, ended: bool = False) -> None:
        """One small UPDATE, tried even after a failed batch: it often fits where a batch did not.
        If it cannot be written either, readers call the run crashed once its process is gone."""
        try:
            with self._db.atomic():
                self._db.execute(
                    "UPDATE runs SET status = ?, status_detail = ?, num_dropped_records = ?"
                    + (", ended_at = ?" if ended else "") + " WHERE id = ?",
                    [status, detail, self.num_dropped_records, *([utc_now()] if ended else []), self.run_id])
        except Exception:
            pass


def _ending(exc: BaseException | None) -> tuple[str, str | None]:
    """(status, detail) for a run ended by ``exc``: None or Ctrl-C is the user ending it."""
    if exc is None or isinstance(exc, KeyboardInterrupt):
        return "finished", None
    return "crashed", f"{type(exc).__name__}: {exc}"


def _insert(db: sqlite_utils.Database, table: str, rows: list[dict], *,
            verb: str = "INSERT", upsert_on: tuple[str, ...] = ()) -> None:
    """One executemany per table. Every row of a list has the same keys, so sqlite-utils'
    per-value type sniffing in insert_all (a third of the writer's time) buys nothing here."""
    if not rows:
        return
    columns = list(rows[0])
    sql = f"{verb} INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
    if upsert_on:
        updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in upsert_on)
        sql += f" ON CONFLICT ({', '.join(upsert_on)}) DO UPDATE SET {updates}"
    db.conn.executemany(sql, [tuple(row.values()) for row in rows])
