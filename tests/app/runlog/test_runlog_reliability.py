"""The run log when things go wrong (issue 13, items 14 to 16): a full disk, runs that end badly,
read-only mounts, removing a run still being written, bad ids."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import sqlite_utils
from cli_helpers import kvscope, one_error_line
from runlog_faults import fill_the_disk, make_log

from kvscope.app import cli
from kvscope.app.bench.systems_cli import log_opener
from kvscope.app.runlog import SCHEMA_VERSION, RunLogReader, record_run, schema
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine

CONFIG = EngineConfig(num_blocks=64, max_model_len=256)
# Children start outside the checkout: `python -c` puts the working directory on sys.path.
OUTSIDE = tempfile.gettempdir()


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=OUTSIDE)


# --- a full disk ------------------------------------------------------------------------------


def test_a_full_disk_warns_once_while_the_engine_runs_on_and_marks_the_run_incomplete(tmp_path, monkeypatch):
    path = tmp_path / "runs.db"
    fill_the_disk(monkeypatch, path)
    engine = fake_engine(CONFIG)
    warnings: list[str] = []
    with record_run(engine, db_path=path, on_failure=warnings.append) as logger:
        assert logger.enabled, logger.warning
        for i in range(6):
            engine.add_request("abcdefgh" * 4, SamplingParams(max_tokens=120, ignore_eos=True), request_id=str(i))
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step().outputs if o.finished]
            if not warnings:
                time.sleep(0.005)   # let the writer reach the disk while requests still run
        assert warnings, "the log never reported the failed write"
    assert sorted(finished) == [str(i) for i in range(6)]       # every request ran to the end
    assert len(warnings) == 1 and "database or disk is full" in warnings[0]
    assert "the run continues without it" in warnings[0]
    run = RunLogReader(path).run(logger.run_id)
    assert run["status"] == "incomplete"
    assert "database or disk is full" in run["status_detail"] and run["ended_at"]
    assert run["num_steps"] < 120


FULL_DISK_SCRIPT = """
    import os, resource, signal, sys
    from kvscope.app.runlog import record_run
    from kvscope.engine.config import EngineConfig, SamplingParams
    from kvscope.engine.fake_runner import fake_engine

    db = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # a write past the limit fails with EFBIG instead
    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=512))
    log = record_run(engine, db_path=db, on_failure=lambda w: print(f"kvscope: {w}", file=sys.stderr))
    largest = max(os.path.getsize(db + suffix) for suffix in ("", "-wal") if os.path.exists(db + suffix))
    resource.setrlimit(resource.RLIMIT_FSIZE, (largest + 16384, resource.RLIM_INFINITY))
    for i in range(4):
        engine.add_request("x" * 40, SamplingParams(max_tokens=400, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    log.close()
    print(steps, log.run_id)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
def test_a_file_size_limit_fails_the_writes_of_a_real_process_and_it_still_exits_normally(tmp_path):
    """The operating system refuses the writes (EFBIG, as ENOSPC on a full disk): the run ends
    normally, stderr has one line, and the run is incomplete, not crashed."""
    path = tmp_path / "runs.db"
    done = run_python(FULL_DISK_SCRIPT, str(path))
    assert done.returncode == 0, done.stderr
    steps, run_id = map(int, done.stdout.split())
    assert steps >= 400     # every token of the four requests was generated
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "run log stopped writing" in lines[0], done.stderr
    run = RunLogReader(path).run(run_id)
    assert run["status"] == "incomplete" and run["status_detail"], run
    assert run["num_steps"] < steps


def test_chat_says_in_one_stderr_line_that_the_log_stopped(tmp_path, monkeypatch, capsys):
    path = tmp_path / "runs.db"
    fill_the_disk(monkeypatch, path)
    monkeypatch.setattr("kvscope.engine.LLMEngine", lambda config: fake_engine(config))
    assert cli.main(["chat", "hello there", "--max-tokens", "200", "--num-blocks", "64", "--max-model-len",
                     "512", "--db", str(path)]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "run log" in line]
    assert len(lines) == 1 and lines[0].startswith("kvscope: run log stopped writing")


def test_bench_says_it_once_for_all_its_runs(tmp_path, monkeypatch, capsys):
    path = tmp_path / "runs.db"
    fill_the_disk(monkeypatch, path)
    open_log = log_opener(path)
    for _ in range(3):
        engine = fake_engine(CONFIG)
        logger = open_log(engine)
        engine.generate(["y" * 30] * 4, SamplingParams(max_tokens=100, ignore_eos=True))
        logger.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if "run log" in line]
    assert len(lines) == 1 and lines[0].startswith("kvscope bench: run log"), lines


# --- how a run ended ----------------------------------------------------------------------------


ENDINGS = {
    "uncaught exception": ("raise RuntimeError('the script failed')", "crashed", "RuntimeError: the script failed"),
    "normal exit": ("pass", "finished", None),
    "ctrl-c": ("raise KeyboardInterrupt", "finished", None),
    "work in flight": ("engine.add_request('abc', SamplingParams(max_tokens=3))", "interrupted", "1 request"),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_script_without_with_is_recorded_as_it_ended(tmp_path, ending):
    code, status, detail = ENDINGS[ending]
    done = run_python(f"""
        import sys
        from kvscope.app.runlog import record_run
        from kvscope.engine.config import EngineConfig, SamplingParams
        from kvscope.engine.fake_runner import fake_engine
        engine = fake_engine(EngineConfig(num_blocks=16, max_model_len=64))
        log = record_run(engine, db_path=sys.argv[1])
        engine.generate(["abc"], SamplingParams(max_tokens=3))
        {code}
    """, str(tmp_path / "runs.db"))
    (run,) = RunLogReader(tmp_path / "runs.db").list_runs()
    full = RunLogReader(tmp_path / "runs.db").run(run["id"])
    assert full["status"] == status, (done.stderr, full)
    assert (detail is None and full["status_detail"] is None) or detail in full["status_detail"]


def test_an_older_log_gets_the_status_detail_column(tmp_path):
    path = tmp_path / "runs.db"
    db = sqlite_utils.Database(path)
    schema.MIGRATIONS[1](db)
    db.execute("PRAGMA user_version = 1")
    db["runs"].insert({"started_at": "2026-01-01T00:00:00+00:00", "status": "finished", "source": "app"})
    db.close()
    make_log(path)
    db = sqlite_utils.Database(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert "status_detail" in db["runs"].columns_dict
    assert [row["status"] for row in RunLogReader(path).list_runs()] == ["finished", "finished"]


# --- kvscope runs ---------------------------------------------------------------------------------


READ_ONLY_LIST = """
    import sys
    from kvscope.app.cli import main
    sys.exit(main(["runs", "--db", sys.argv[1]]))
"""


def test_runs_reads_a_wal_log_on_a_read_only_mount(tmp_path):
    """A log closed cleanly is a WAL file with no -wal or -shm beside it; on a read-only mount SQLite
    cannot create the -shm, and mode=ro alone fails with "attempt to write a readonly database"."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a read-only bind mount")
    source, mount = tmp_path / "logs", tmp_path / "mnt"
    source.mkdir()
    mount.mkdir()
    make_log(source / "runs.db")
    assert not (source / "runs.db-shm").exists()
    script = (f"mount --bind -o ro {source} {mount} && exec {sys.executable} -c '{textwrap.dedent(READ_ONLY_LIST)}'"
              f" {mount / 'runs.db'}")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=OUTSIDE)
    if "Operation not permitted" in done.stderr or "cannot" in done.stderr and "mount" in done.stderr:
        pytest.skip(f"no read-only bind mount here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert "finished" in done.stdout.splitlines()[1]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_runs_reads_a_wal_log_in_a_read_only_directory(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    make_log(logs / "runs.db")
    logs.chmod(0o555)
    try:
        assert kvscope("runs", "--db", str(logs / "runs.db")) == 0
    finally:
        logs.chmod(0o755)
    assert "finished" in capsys.readouterr().out


def test_removing_a_run_still_being_written_is_refused(tmp_path, capsys):
    path = tmp_path / "runs.db"
    engine = fake_engine(CONFIG)
    with record_run(engine, db_path=path) as logger:
        engine.generate(["abc"], SamplingParams(max_tokens=4))
        assert kvscope("runs", "rm", str(logger.run_id), "--db", str(path)) == 2
        assert "still being written" in one_error_line(capsys)
        engine.generate(["def"], SamplingParams(max_tokens=4))
    run = RunLogReader(path).run(logger.run_id)
    assert run["status"] == "finished" and run["num_requests"] == 2
    assert kvscope("runs", "rm", str(logger.run_id), "--db", str(path)) == 0
