"""Is the process that started a run still alive? Decides when a "running" run has crashed.

A pid alone is not enough: after a crash the pid may be reused by an unrelated
process. The run stores the pid's creation time as well, and both must match.
"""

from __future__ import annotations

import socket
from datetime import datetime, timezone

import psutil
import sqlite_utils

# psutil reports creation times rounded differently across platforms.
_CREATE_TIME_TOLERANCE_S = 1.0


def current_process_identity() -> tuple[int, float, str]:
    """(pid, creation time, hostname) to store with a new run."""
    me = psutil.Process()
    return me.pid, me.create_time(), socket.gethostname()


def process_alive(pid: int | None, started_at: float | None, hostname: str | None) -> bool:
    """False only when the run's process certainly ended; unknown cases count as alive."""
    if pid is None or hostname != socket.gethostname():
        return True  # another machine's run (a shared file system): we cannot tell
    try:
        process = psutil.Process(pid)
        created = process.create_time()
        if process.status() == psutil.STATUS_ZOMBIE:
            return False  # killed, not yet reaped by its parent
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
    return started_at is None or abs(created - started_at) <= _CREATE_TIME_TOLERANCE_S


def mark_crashed_runs(db: sqlite_utils.Database) -> list[int]:
    """Mark "running" runs whose process is gone as crashed; their end is their last logged step."""
    running = db.query("SELECT id, pid, pid_started_at, hostname FROM runs WHERE status = 'running'")
    crashed = [row["id"] for row in running
               if not process_alive(row["pid"], row["pid_started_at"], row["hostname"])]
    with db.atomic():
        for run_id in crashed:
            last = db.execute("SELECT max(time) FROM steps WHERE run_id = ?", [run_id]).fetchone()[0]
            ended = None
            if last is not None:
                ended = datetime.fromtimestamp(last, timezone.utc).isoformat(timespec="milliseconds")
            db.execute("UPDATE runs SET status = 'crashed', ended_at = ? WHERE id = ?", [ended, run_id])
    return crashed
