"""Reading the run log back: listing, summaries, export, removal and step-by-step replay."""

from __future__ import annotations

import bisect
import contextlib
import csv
import dataclasses
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import sqlite_utils

from kvscope.app.runlog.liveness import process_alive
from kvscope.app.runlog.schema import GROUP_COLUMNS, check_readable, connect
from kvscope.app.runlog.snapshots import SnapshotDecoder
from kvscope.engine.outputs import CacheSnapshot, EngineEvent, EventKind, StepStats

EXPORT_TABLES = ("steps", "requests", "events")
# A replay keeps the decoder as it stood every CHECKPOINT_FRAMES frames, the newest MAX_CHECKPOINTS of them: a step
# back then decodes at most that many frames. Each holds the pool's arrays (5 MB at 330,000 blocks).
CHECKPOINT_FRAMES = 50
MAX_CHECKPOINTS = 10
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(StepStats))
_KINDS = {kind.value: kind for kind in EventKind}


class RunNotFound(LookupError):
    pass


class RunInUse(RuntimeError):
    """The run is still being written by a live process: removing it would break that writer."""


class DamagedRunLog(ValueError):
    """A row of the run log cannot be decoded (a corrupt snapshot blob)."""


@contextlib.contextmanager
def _decoding(run_id: int, step: int):
    """Whatever a damaged blob makes the decoder raise (zlib, struct, json, numpy) becomes DamagedRunLog."""
    try:
        yield
    except Exception as exc:
        raise DamagedRunLog(f"run {run_id}, step {step}: the recorded snapshot cannot be decoded "
                            f"({type(exc).__name__}: {exc})") from exc


def run_origin(run: dict) -> str:
    """What started a run: its source, and its label when it has one ("lesson fragmentation")."""
    label = run.get("label")
    return f"{run.get('source') or '-'} {label}" if label else run.get("source") or "-"


@dataclass(frozen=True)
class ReplayFrame:
    """Everything the live view shows for one step, rebuilt from the log."""

    stats: StepStats
    snapshot: CacheSnapshot
    events: tuple[EngineEvent, ...]


def _stats(row: dict) -> StepStats:
    fields = {name: row[name] for name in _STATS_FIELDS if name in row}
    for name in GROUP_COLUMNS:   # JSON lists; NULL (one group, or an older log): none
        fields[name] = tuple(json.loads(row.get(name) or "[]"))
    return StepStats(**fields)


def _event(row: dict) -> EngineEvent:
    kind = row["kind"]
    # A kind this version does not know (a newer kvscope's log) stays a plain string, still shown.
    return EngineEvent(kind=_KINDS.get(kind, kind), request_id=row["request_id"],
                       blocks=tuple(json.loads(row["blocks"] or "[]")), detail=row["detail"] or "")


def _events_by_step(db: sqlite_utils.Database, run_id: int, first: int,
                    last: int) -> dict[int, tuple[EngineEvent, ...]]:
    grouped: dict[int, list[EngineEvent]] = defaultdict(list)
    for row in db.query("SELECT * FROM events WHERE run_id = ? AND step BETWEEN ? AND ? ORDER BY id",
                        [run_id, first, last]):
        grouped[row["step"]].append(_event(row))
    return {step: tuple(events) for step, events in grouped.items()}


class RunLogReader:
    """A connection to an existing run log. Read-only unless ``writable`` (needed by ``delete``)."""

    def __init__(self, path: str | Path, *, writable: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no run log at {self.path}")
        self.db = connect(str(self.path), read_only=not writable)
        try:
            check_readable(self.db, str(self.path))
        except Exception:
            self.db.close()
            raise

    def close(self) -> None:
        self.db.close()

    # --- runs ----------------------------------------------------------------------

    def list_runs(self) -> list[dict]:
        """One row per run, newest first, with requests, tokens, mean tok/s and live status."""
        if "runs" not in self.db.table_names():
            return []
        rows = list(self.db.query("SELECT * FROM run_summary ORDER BY id DESC"))
        for row in rows:
            row["status"] = self._live_status(row)
        return rows

    def _live_status(self, row: dict) -> str:
        # A run still "running" whose process is gone crashed; say so even before the
        # next writer marks it (readers do not write).
        if row["status"] != "running" or process_alive(row["pid"], row["pid_started_at"], row["hostname"]):
            return row["status"]
        return "crashed"

    def run(self, run_id: int) -> dict:
        """The run's row, its parsed config, and the aggregates `kvscope runs show` prints."""
        found = list(self.db.query("SELECT * FROM runs WHERE id = ?", [run_id]))
        if not found:
            raise RunNotFound(f"no run with id {run_id} in {self.path}")
        run = found[0]
        run["status"] = self._live_status(run)
        run["config"] = json.loads(run["config"] or "{}")
        run.update(self._one("""
            SELECT count(*) AS num_steps, min(step) AS first_step, max(step) AS last_step,
                   sum(duration) AS busy_seconds, sum(num_generated_tokens) AS num_generated_tokens,
                   sum(num_prefill_tokens) AS num_prefill_tokens, max(kv_usage) AS peak_kv_usage,
                   avg(kv_usage) AS mean_kv_usage, max(num_preemptions) AS num_preemptions,
                   max(prefix_cache_queries) AS prefix_cache_queries,
                   max(prefix_cache_hits) AS prefix_cache_hits,
                   max(num_swapped_out_blocks) AS num_swapped_out_blocks
            FROM steps WHERE run_id = ?""", run_id))
        busy, generated = run["busy_seconds"], run["num_generated_tokens"]
        run["mean_tokens_per_s"] = generated / busy if busy else None
        run.update(self._one("""
            SELECT count(*) AS num_requests, count(finish_reason) AS num_finished_requests,
                   sum(num_output_tokens) AS num_output_tokens, sum(num_prompt_tokens) AS num_prompt_tokens,
                   avg(first_token_time - arrival_time) AS mean_time_to_first_token,
                   avg(finish_time - arrival_time) AS mean_latency
            FROM requests WHERE run_id = ?""", run_id))
        run["finish_reasons"] = dict(self.db.execute(
            "SELECT finish_reason, count(*) FROM requests WHERE run_id = ? AND finish_reason IS NOT NULL "
            "GROUP BY finish_reason ORDER BY finish_reason", [run_id]).fetchall())
        run["events"] = dict(self.db.execute(
            "SELECT kind, count(*) FROM events WHERE run_id = ? GROUP BY kind ORDER BY kind", [run_id]
        ).fetchall())
        return run

    def _one(self, sql: str, run_id: int) -> dict:
        return next(self.db.query(sql, [run_id]))

    def _require(self, run_id: int) -> None:
        if self.db.execute("SELECT 1 FROM runs WHERE id = ?", [run_id]).fetchone() is None:
            raise RunNotFound(f"no run with id {run_id} in {self.path}")

    def delete(self, run_id: int) -> None:
        """Remove the run; foreign keys cascade to its requests, steps, events and snapshots.
        RunInUse if its process is still writing it."""
        self._require(run_id)
        (row,) = self.db.query("SELECT status, pid, pid_started_at, hostname FROM runs WHERE id = ?", [run_id])
        if self._live_status(row) == "running":
            raise RunInUse(f"run {run_id} is still being written by process {row['pid']} on {row['hostname']}; "
                           "end that kvscope first")
        with self.db.atomic():
            self.db.execute("DELETE FROM runs WHERE id = ?", [run_id])

    # --- rows ----------------------------------------------------------------------

    def rows(self, table: str, run_id: int) -> list[dict]:
        if table not in EXPORT_TABLES:
            raise ValueError(f"table must be one of {EXPORT_TABLES}, got {table!r}")
        self._require(run_id)
        order = {"steps": "step", "requests": "arrival_time, request_id", "events": "id"}[table]
        return list(self.db.query(f"SELECT * FROM {table} WHERE run_id = ? ORDER BY {order}", [run_id]))

    def steps(self, run_id: int) -> list[StepStats]:
        return [_stats(row) for row in self.rows("steps", run_id)]

    def export(self, run_id: int, out: TextIO, fmt: str = "json", table: str = "steps") -> None:
        """JSON: the summary and every table in one document. CSV: one table (steps by default)."""
        if fmt == "json":
            document = {"run": self.run(run_id)}
            document.update((name, self.rows(name, run_id)) for name in EXPORT_TABLES)
            json.dump(document, out, indent=1)
            out.write("\n")
        elif fmt == "csv":
            rows = self.rows(table, run_id)
            columns = [c.name for c in self.db[table].columns]
            writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        else:
            raise ValueError(f"format must be json or csv, got {fmt!r}")

    # --- replay --------------------------------------------------------------------

    def _frames(self, run_id: int, first: int, last: int) -> Iterator[ReplayFrame]:
        """Frames for steps first..last; ``first`` must be a keyframe."""
        events = _events_by_step(self.db, run_id, first, last)
        decoder = SnapshotDecoder()
        rows = self.db.query(
            "SELECT steps.*, snapshots.data FROM steps JOIN snapshots USING (run_id, step) "
            "WHERE run_id = ? AND step BETWEEN ? AND ? ORDER BY step", [run_id, first, last])
        for row in rows:
            with _decoding(run_id, row["step"]):
                decoder.advance(row["data"])
                snapshot = decoder.snapshot()
            yield ReplayFrame(_stats(row), snapshot, events.get(row["step"], ()))

    def iter_snapshots(self, run_id: int) -> Iterator[ReplayFrame]:
        """Every recorded step of the run, in order."""
        self._require(run_id)
        first = self.db.execute("SELECT min(step) FROM snapshots WHERE run_id = ? AND keyframe = 1",
                                [run_id]).fetchone()[0]
        if first is None:
            return
        yield from self._frames(run_id, first, 2**62)

    def replay(self, run_id: int) -> Replay:
        """A cursor over the run's steps for the history screen (jump anywhere, step on cheaply)."""
        self._require(run_id)
        return Replay(self, run_id)

    def frames(self, run_id: int, first: int, last: int) -> Iterator[ReplayFrame]:
        """The frames of the recorded steps from ``first`` to ``last``, decoded from the keyframe before ``first``."""
        self._require(run_id)
        keyframe = self.db.execute("SELECT max(step) FROM snapshots WHERE run_id = ? AND keyframe = 1 AND step <= ?",
                                   [run_id, first]).fetchone()[0]
        if keyframe is None:
            return
        yield from (frame for frame in self._frames(run_id, keyframe, last) if frame.stats.step >= first)

    def final_figures(self, run_id: int) -> dict[str, tuple[int, int, int, str]]:
        """What each finished request of the run ended with, as its final output said it: (output tokens,
        preemptions, cached prompt tokens, finish reason) by request id."""
        self._require(run_id)
        rows = self.db.query("SELECT request_id, num_output_tokens, num_preemptions, num_cached_tokens, "
                             "finish_reason FROM requests WHERE run_id = ? AND finish_reason IS NOT NULL", [run_id])
        return {row["request_id"]: (row["num_output_tokens"] or 0, row["num_preemptions"] or 0,
                                    row["num_cached_tokens"] or 0, row["finish_reason"]) for row in rows}

    def snapshot_at(self, run_id: int, step: int) -> ReplayFrame:
        """The frame of ``step``, or of the last recorded step before it."""
        return self.replay(run_id).frame(step)

    def recorded_steps(self, run_id: int) -> list[int]:
        return self.replay(run_id).steps


class Replay:
    """One run's recorded steps. Moving forward decodes only the steps in between; moving back or far ahead
    restarts from the nearest keyframe (at most MAX_KEYFRAME_INTERVAL frames away) or, nearer, from a checkpoint:
    the decoder as it stood every CHECKPOINT_FRAMES frames it decoded, the newest MAX_CHECKPOINTS kept. A big
    pool's keyframes are hundreds of frames apart, and a step back from the frame before one decoded them all."""

    def __init__(self, reader: RunLogReader, run_id: int):
        self._reader, self.run_id = reader, run_id
        rows = reader.db.execute("SELECT step, keyframe FROM snapshots WHERE run_id = ? ORDER BY step",
                                 [run_id]).fetchall()
        self.steps: list[int] = [step for step, _ in rows]
        self._keyframes = [step for step, keyframe in rows if keyframe]
        self._decoder = SnapshotDecoder()
        self._current: ReplayFrame | None = None
        self._checkpoints: dict[int, SnapshotDecoder] = {}     # by the step each stands at, oldest first
        self._since_checkpoint = 0

    def frame(self, step: int) -> ReplayFrame:
        """The frame of ``step``, or of the last recorded step before it."""
        index = bisect.bisect_right(self.steps, step) - 1
        keyframe_index = bisect.bisect_right(self._keyframes, self.steps[index]) - 1 if index >= 0 else -1
        if keyframe_index < 0:
            raise RunNotFound(f"run {self.run_id} has no recorded step at or before {step}")
        target, keyframe = self.steps[index], self._keyframes[keyframe_index]
        position = self._current.stats.step if self._current else None
        if position == target:
            return self._current
        position = self._start(keyframe, position, target)
        try:
            row = self._decode_until(position, target)
            with _decoding(self.run_id, target):
                snapshot = self._decoder.snapshot()
        except DamagedRunLog:
            self._decoder, self._current = SnapshotDecoder(), None    # start afresh from a keyframe next time
            self._checkpoints.clear()
            raise
        events = _events_by_step(self._reader.db, self.run_id, target, target).get(target, ())
        self._current = ReplayFrame(_stats(row), snapshot, events)
        return self._current

    def _start(self, keyframe: int, position: int | None, target: int) -> int:
        """Set the decoder where decoding up to ``target`` has least to do; the step it stands at (the one before
        ``keyframe``, for a fresh decoder)."""
        start = keyframe - 1
        if position is not None and keyframe <= position < target:
            start = position
        # Before the target, not at it: the target's own row is read for its stats.
        checkpoint = max((at for at in self._checkpoints if start < at < target), default=None)
        if checkpoint is not None:
            self._decoder, start = self._checkpoints[checkpoint].copy(), checkpoint
            self._since_checkpoint = 0
        elif start != position:
            self._decoder, self._since_checkpoint = SnapshotDecoder(), 0
        return start

    def _decode_until(self, position: int, target: int) -> dict:
        """Apply the frames after ``position`` up to ``target``; the last row read."""
        row = None
        for row in self._reader.db.query(
                "SELECT steps.*, snapshots.data FROM steps JOIN snapshots USING (run_id, step) "
                "WHERE run_id = ? AND step > ? AND step <= ? ORDER BY step", [self.run_id, position, target]):
            with _decoding(self.run_id, row["step"]):
                self._decoder.advance(row["data"])
            self._since_checkpoint += 1
            if self._since_checkpoint >= CHECKPOINT_FRAMES:
                self._keep_checkpoint(row["step"])
        return row

    def _keep_checkpoint(self, step: int) -> None:
        self._since_checkpoint = 0
        if step not in self._checkpoints:
            self._checkpoints[step] = self._decoder.copy()
            if len(self._checkpoints) > MAX_CHECKPOINTS:
                del self._checkpoints[next(iter(self._checkpoints))]
