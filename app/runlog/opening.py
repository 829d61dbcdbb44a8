"""open_run_log: start logging one run, or explain in one line why logging is off."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import sqlite_utils

from kvscope import __version__
from kvscope.app.runlog.liveness import current_process_identity, mark_crashed_runs
from kvscope.app.runlog.schema import SchemaError, connect, prepare
from kvscope.app.runlog.writer import RunLogger, utc_now
from kvscope.engine.config import EngineConfig
from kvscope.settings import settings

SOURCES = ("app", "bench", "chat", "lesson", "script", "serve", "vllm")


def open_run_log(path: str | Path | None, *, source: str, config: EngineConfig, model: str,
                 device: str, dtype: str, enabled: bool = True,
                 on_failure: Callable[[str], None] | None = None, label: str | None = None,
                 keep_empty: bool = True) -> RunLogger:
    """A logger for a new run in the database at ``path`` (default: the user data dir).

    Never raises for a bad file or directory: the logger comes back disabled, with
    ``warning`` saying what is wrong with which path and how to fix it. If the log
    stops writing later (a full disk), ``on_failure(warning)`` is called once. ``label`` says what started
    the run within its source (the lesson's name); ``keep_empty=False`` leaves no run behind if nothing was
    asked of the engine.
    """
    return open_observed_run_log(
        path, source=source, model=model, device=device, dtype=dtype, block_size=config.block_size,
        num_blocks=config.num_blocks, config=dataclasses.asdict(config), enabled=enabled, on_failure=on_failure,
        label=label, keep_empty=keep_empty)


def open_observed_run_log(path: str | Path | None, *, source: str, model: str, device: str, dtype: str,
                          block_size: int, num_blocks: int | None, config: dict, enabled: bool = True,
                          on_failure: Callable[[str], None] | None = None, label: str | None = None,
                          keep_empty: bool = True) -> RunLogger:
    """open_run_log for a run kvscope watches rather than runs (``kvscope attach``: source "vllm"),
    described by a plain ``config`` mapping instead of an EngineConfig."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if not enabled:
        return RunLogger.disabled(None)
    path = Path(path).expanduser() if path is not None else settings().db_path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return RunLogger.disabled(path, f"run log off: cannot create the directory {path.parent} "
                                  f"({exc.strerror}); make it writable, pass --db PATH, or use --no-log")
    db = None
    try:
        db = connect(str(path))
        prepare(db, str(path))
        mark_crashed_runs(db)
        run_id = _insert_run(db, source, model, device, dtype, block_size, num_blocks, config, label)
    except SchemaError as exc:
        _close_quietly(db)
        return RunLogger.disabled(path, f"run log off: {exc}")
    except (sqlite3.Error, OSError) as exc:
        _close_quietly(db)
        return RunLogger.disabled(path, explain(path, exc))
    return RunLogger(path, db=db, run_id=run_id, on_failure=on_failure, keep_empty=keep_empty)


def record_run(engine, *, source: str = "script", db_path: str | Path | None = None,
               enabled: bool = True, on_failure: Callable[[str], None] | None = None, label: str | None = None,
               keep_empty: bool = True) -> RunLogger:
    """Log everything ``engine`` does from now on as one run; close the logger (or use it in a
    ``with`` block) to end the run. Like open_run_log, it never raises for a bad database.

    This is the one way a run is recorded: the app, the bench, ``kvscope chat`` and scripts all
    call it, and the logger hears of each request and step as an engine observer."""
    info = engine.info
    # The resolved max_model_len, so a replay can draw the contiguous comparison.
    config = dataclasses.replace(engine.config, max_model_len=engine.max_model_len)
    logger = open_run_log(db_path, source=source, config=config, enabled=enabled,
                          model=info.model_name, device=info.device, dtype=info.dtype, on_failure=on_failure,
                          label=label, keep_empty=keep_empty)
    if logger.enabled:
        logger.detach = engine.add_observer(logger)
    return logger


def explain(path: Path, exc: Exception) -> str:
    """One line naming the path, what is wrong with it and the fix."""
    reason = str(exc)
    lowered = reason.lower()
    if "locked" in lowered or "busy" in lowered:
        return f"run log off: {path} is locked by another program; close it, pass --db PATH, or use --no-log"
    if "not a database" in lowered or "malformed" in lowered or "corrupt" in lowered:
        return (f"run log off: {path} is not a readable SQLite database ({reason}); "
                "move it aside, pass --db PATH, or use --no-log")
    return f"run log off: cannot write {path} ({reason}); make it writable, pass --db PATH, or use --no-log"


def _insert_run(db: sqlite_utils.Database, source: str, model: str, device: str, dtype: str,
                block_size: int, num_blocks: int | None, config: dict, label: str | None = None) -> int:
    pid, pid_started_at, hostname = current_process_identity()
    row = {
        "started_at": utc_now(), "status": "running", "source": source,
        "kvscope_version": __version__, "model": model, "device": device, "dtype": dtype,
        "block_size": block_size, "num_blocks": num_blocks,
        "config": json.dumps(config, default=str),
        "pid": pid, "pid_started_at": pid_started_at, "hostname": hostname, "label": label,
    }
    return db["runs"].insert(row).last_pk


def _close_quietly(db: sqlite_utils.Database | None) -> None:
    if db is not None:
        try:
            db.close()
        except sqlite3.Error:
            pass


@dataclass(frozen=True)
class RunLogSpec:
    """Where and as what each engine built from now on is logged (app/runlog): a lesson's engines as the lesson's,
    the app's as the app's. Plain values, so the spec crosses to an engine process as any command does."""

    source: str
    label: str | None
    db_path: str | None
    enabled: bool

    def open(self, engine, on_failure: Callable[[str], None]):
        """The run log of ``engine``, attached as its observer; an engine replaced before anything was asked of it
        leaves no run behind (keep_empty=False)."""
        return record_run(engine, source=self.source, label=self.label, keep_empty=False, db_path=self.db_path,
                          enabled=self.enabled, on_failure=on_failure)
