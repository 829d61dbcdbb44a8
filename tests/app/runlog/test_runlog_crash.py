"""Crash safety with a real process: SIGKILL mid-run, and a script that exits without closing."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvscope.app.runlog import RunLogReader, open_run_log
from kvscope.engine.config import EngineConfig

SUPPORT_DIR = Path(__file__).parents[2] / "support"   # where synthetic_engine lives, for the child

CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from synthetic_engine import SyntheticEngine
    from kvscope.app.runlog import open_run_log
    from kvscope.engine.config import EngineConfig

    path, mode = sys.argv[2], sys.argv[3]
    logger = open_run_log(path, source="script", config=EngineConfig(device="cpu", num_blocks=64),
                          model="synthetic", device="cpu", dtype="float32")
    engine = SyntheticEngine(64, max_running=6, arrivals_per_step=0.2, seed=7)
    if mode == "exit":  # log 40 steps and leave without close(): atexit must flush
        for _ in range(40):
            logger.step(engine.step())
        sys.exit(0)
    while True:  # run until killed
        logger.step(engine.step())
        time.sleep(0.002)
""")

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")


def start_child(path: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(SUPPORT_DIR), str(path), mode],
                            cwd=path.parent, stderr=subprocess.PIPE, text=True)


def committed_steps(path: Path) -> int:
    if not path.exists():
        return 0
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute("SELECT count(*) FROM steps").fetchone()[0]
    except sqlite3.OperationalError:  # the schema is not there yet
        return 0
    finally:
        conn.close()


def test_sigkill_mid_run_keeps_every_flushed_step_and_the_next_open_marks_it_crashed(tmp_path):
    path = tmp_path / "runs.db"
    child = start_child(path, "run")
    try:
        deadline = time.monotonic() + 120  # a hang guard, not a speed check
        while (seen := committed_steps(path)) < 30:
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, "the child logged nothing"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL

    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    steps = [s for (s,) in conn.execute("SELECT step FROM steps ORDER BY step")]
    assert len(steps) >= seen and steps == list(range(len(steps)))
    assert conn.execute("SELECT count(*) FROM snapshots").fetchone()[0] == len(steps)
    assert conn.execute("SELECT status FROM runs").fetchone()[0] == "running"
    conn.close()

    reader = RunLogReader(path)
    (run,) = reader.list_runs()
    assert run["status"] == "crashed"  # the reader already tells, without writing
    last = reader.snapshot_at(run["id"], steps[-1])
    assert last.stats.step == steps[-1] and last.snapshot.step == steps[-1]
    reader.close()

    logger = open_run_log(path, source="script", config=EngineConfig(device="cpu"), model="m",
                          device="cpu", dtype="float32")
    logger.close()
    crashed = RunLogReader(path).run(run["id"])
    assert crashed["status"] == "crashed" and crashed["ended_at"] is not None
    assert crashed["num_steps"] == len(steps)


def test_a_script_that_exits_without_close_is_flushed_at_exit(tmp_path):
    path = tmp_path / "runs.db"
    child = start_child(path, "exit")
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr
    (run,) = RunLogReader(path).list_runs()
    assert run["status"] == "finished" and run["num_steps"] == 40
