"""The run log: every engine run recorded in SQLite, for browsing and replay."""

from kvscope.app.runlog.opening import RunLogSpec, open_observed_run_log, open_run_log, record_run
from kvscope.app.runlog.reader import (
    DamagedRunLog,
    Replay,
    ReplayFrame,
    RunInUse,
    RunLogReader,
    RunNotFound,
    run_origin,
)
from kvscope.app.runlog.schema import SCHEMA_VERSION, SchemaError
from kvscope.app.runlog.writer import RunLogger

__all__ = ["SCHEMA_VERSION", "DamagedRunLog", "Replay", "ReplayFrame", "RunInUse", "RunLogReader", "RunLogSpec",
           "RunLogger", "RunNotFound", "SchemaError", "open_observed_run_log", "open_run_log", "record_run",
           "run_origin"]
