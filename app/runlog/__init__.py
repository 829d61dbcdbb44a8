"""The run log: every engine run recorded in SQLite, for browsing and replay."""

from app.runlog.opening import open_run_log, record_run
from app.runlog.reader import Replay, ReplayFrame, RunLogReader, RunNotFound
from app.runlog.schema import SCHEMA_VERSION, SchemaError
from app.runlog.writer import RunLogger

__all__ = ["SCHEMA_VERSION", "Replay", "ReplayFrame", "RunLogReader", "RunLogger", "RunNotFound",
           "SchemaError", "open_run_log", "record_run"]
