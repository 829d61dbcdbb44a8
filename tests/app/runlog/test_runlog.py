"""The run log: schema, writer, reader, fault handling and migrations."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlite_utils
from synthetic_engine import SyntheticEngine

from kvscope.app.runlog import SCHEMA_VERSION, RunLogReader, open_run_log, schema, writer
from kvscope.app.runlog.liveness import current_process_identity, mark_crashed_runs
from kvscope.engine.config import EngineConfig
from kvscope.engine.model import loader
from kvscope.engine.outputs import EventKind, StepStats
from kvscope.settings import settings

CONFIG = EngineConfig(device="cpu", num_blocks=128, block_size=16)


def open_log(path, **overrides):
    options = dict(source="script", config=CONFIG, model="synthetic", device="cpu", dtype="float32")
    return open_run_log(path, **(options | overrides))


def log_synthetic_run(path, num_steps=120, seed=0):
    """Log a synthetic run; return (logger, step results, {request id: prompt text})."""
    engine = SyntheticEngine(128, max_running=12, arrivals_per_step=0.8, seed=seed)
    logger = open_log(path)
    prompts, results = {}, []
    for _ in range(num_steps):
        known = set(engine.requests)
        result = engine.step()
        for request_id in sorted(set(engine.requests) | {o.request_id for o in result.outputs}):
            if request_id not in known and request_id not in prompts:
                prompts[request_id] = f"prompt of {request_id}"
                logger.request_added(request_id, prompts[request_id], 7, 1)
        results.append(result)
        logger.step(result)
    return logger, results, prompts


def file_digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- paths ---------------------------------------------------------------------------


def test_settings_follow_xdg_and_the_kvscope_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSCOPE_CACHE", raising=False)
    monkeypatch.delenv("KVSCOPE_DATA", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    assert settings().data_dir == tmp_path / "xdg-data" / "kvscope"
    assert settings().cache_dir == tmp_path / "xdg-cache" / "kvscope"
    assert settings().db_path == tmp_path / "xdg-data" / "kvscope" / "runs.db"
    assert loader.default_model_dir() == tmp_path / "xdg-cache" / "kvscope" / "models" / loader.DEFAULT_MODEL_NAME
    monkeypatch.setenv("KVSCOPE_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path / "cache"))
    assert settings().data_dir == tmp_path / "data"
    assert settings().cache_dir == tmp_path / "cache"
    assert settings().db_path.parent == tmp_path / "data"
    assert loader.default_model_dir().parent == tmp_path / "cache" / "models"
    # An empty variable is unset; an explicit mapping is read instead of the process environment.
    assert settings({"KVSCOPE_DATA": ""}).data_dir == tmp_path / "xdg-data" / "kvscope"
    assert settings({"KVSCOPE_DATA": "~/runs"}).data_dir == Path("~/runs").expanduser()


def test_default_path_is_used_and_created(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSCOPE_DATA", str(tmp_path / "deep" / "data"))
    logger = open_log(None)
    logger.close()
    assert logger.enabled and logger.path == tmp_path / "deep" / "data" / "runs.db"
    assert logger.path.is_file()


# --- schema --------------------------------------------------------------------------


def test_schema_has_typed_tables_cascading_keys_wal_and_a_version(tmp_path):
    logger = open_log(tmp_path / "runs.db")
    logger.close()
    db = sqlite_utils.Database(tmp_path / "runs.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert set(schema.RUN_TABLES) <= set(db.table_names())
    assert "run_summary" in db.view_names()
    types = {c.name: c.type for c in db["steps"].columns}
    assert types["step"] == "INTEGER" and types["kv_usage"] == "REAL" and types["duration"] == "REAL"
    assert {c.name: c.type for c in db["snapshots"].columns}["data"] == "BLOB"
    for table in ("requests", "steps", "events", "snapshots"):
        (key,) = db[table].foreign_keys
        assert (key.column, key.other_table, key.on_delete) == ("run_id", "runs", "CASCADE")


def test_the_steps_table_is_what_the_schema_says_and_holds_every_stat_but_the_phases(tmp_path):
    # The writer copies the StepStats fields that are steps columns, a list derived from schema.STEP_COLUMNS:
    # a stat added to StepStats without a column (and a migration) shows up here, not as a silent gap.
    logger = open_log(tmp_path / "runs.db")
    logger.close()
    columns = tuple(sqlite_utils.Database(tmp_path / "runs.db")["steps"].columns_dict)
    assert columns == schema.STEP_COLUMNS
    stats = {f.name for f in dataclasses.fields(StepStats)}
    assert stats - set(columns) == {"schedule_duration", "update_duration", "snapshot_duration"}


def test_run_row_records_what_started_it(tmp_path):
    logger = open_log(tmp_path / "runs.db", source="bench", model="SmolLM2-135M-Instruct", dtype="bfloat16")
    logger.close()
    run = RunLogReader(tmp_path / "runs.db").run(logger.run_id)
    assert run["source"] == "bench" and run["status"] == "finished" and run["ended_at"]
    assert run["model"] == "SmolLM2-135M-Instruct" and run["device"] == "cpu" and run["dtype"] == "bfloat16"
    assert run["config"] == json.loads(json.dumps(dataclasses.asdict(CONFIG)))
    assert run["pid"] == os.getpid() and run["kvscope_version"]


def test_unknown_source_is_a_programming_error(tmp_path):
    with pytest.raises(ValueError, match="source"):
        open_log(tmp_path / "runs.db", source="cron")


# --- round trip ----------------------------------------------------------------------


def test_steps_requests_and_events_read_back_as_logged(tmp_path):
    logger, results, prompts = log_synthetic_run(tmp_path / "runs.db")
    logger.close()
    assert logger.enabled and logger.warning is None
    reader = RunLogReader(tmp_path / "runs.db")
    assert reader.steps(logger.run_id) == [r.stats for r in results]

    steps = reader.rows("steps", logger.run_id)
    assert [s["num_generated_tokens"] for s in steps] == [r.stats.num_decode_tokens for r in results]
    assert [s["num_used_blocks"] for s in steps] == [
        r.stats.num_total_blocks - r.stats.num_free_blocks for r in results]

    finished = {o.request_id: o for r in results for o in r.outputs if o.finished}
    requests = {row["request_id"]: row for row in reader.rows("requests", logger.run_id)}
    assert set(requests) == set(prompts)
    for request_id, output in finished.items():
        row = requests[request_id]
        assert row["prompt_text"] == prompts[request_id] and row["n"] == 1
        assert row["output_text"] == output.text and row["num_output_tokens"] == len(output.token_ids)
        assert row["finish_reason"] == "length" and row["num_prompt_tokens"] == len(output.prompt_token_ids)
        assert row["finish_time"] == output.metrics.finished_time
        assert row["num_preemptions"] == output.num_preemptions
    unfinished = set(prompts) - set(finished)
    assert all(requests[r]["finish_reason"] is None for r in unfinished)

    events = reader.rows("events", logger.run_id)
    expected = [(r.stats.step, e.kind, e.request_id, list(e.blocks)) for r in results for e in r.events]
    assert [(e["step"], e["kind"], e["request_id"], json.loads(e["blocks"])) for e in events] == expected
    assert {"evict", "preempt"} <= {e["kind"] for e in events}
    replayed = [e for step in reader.recorded_steps(logger.run_id)
                for e in reader.snapshot_at(logger.run_id, step).events]
    assert {e.kind for e in replayed} <= set(EventKind) and EventKind.EVICT in {e.kind for e in replayed}
    reader.close()


def test_summary_and_listing_agree_with_the_steps(tmp_path):
    logger, results, prompts = log_synthetic_run(tmp_path / "runs.db", num_steps=60)
    logger.close()
    reader = RunLogReader(tmp_path / "runs.db")
    (listed,) = reader.list_runs()
    generated = sum(r.stats.num_decode_tokens for r in results)
    busy = sum(r.stats.duration for r in results)
    assert listed["num_requests"] == len(prompts) and listed["num_generated_tokens"] == generated
    assert listed["mean_tokens_per_s"] == pytest.approx(generated / busy)
    run = reader.run(logger.run_id)
    assert run["num_steps"] == 60 and run["num_blocks"] == 128
    assert run["peak_kv_usage"] == max(r.stats.kv_usage for r in results)
    assert run["num_preemptions"] == results[-1].stats.num_preemptions


def test_n_greater_than_one_counts_every_sample(tmp_path):
    base = SyntheticEngine(32, max_running=1, arrivals_per_step=0, seed=1)
    base.add_request()
    logger = open_log(tmp_path / "runs.db")
    first = base.step()
    output = first.outputs[0]
    samples = (output.samples[0], output.samples[0]._replace(index=1, text="other"))
    final = output._replace(finished=True, finish_reason="length", samples=samples)
    logger.step(dataclasses.replace(first, outputs=[final]))
    logger.close()
    (row,) = RunLogReader(tmp_path / "runs.db").rows("requests", logger.run_id)
    assert row["num_output_tokens"] == 2 * len(output.token_ids)
    assert json.loads(row["sample_texts"]) == [output.text, "other"]


def test_delete_cascades_to_every_child_row(tmp_path):
    first, _, _ = log_synthetic_run(tmp_path / "runs.db", num_steps=30)
    first.close()
    second, _, _ = log_synthetic_run(tmp_path / "runs.db", num_steps=30, seed=1)
    second.close()
    db = sqlite_utils.Database(tmp_path / "runs.db")

    def counts():
        return {table: dict(db.execute(f"SELECT run_id, count(*) FROM {table} GROUP BY run_id").fetchall())
                for table in ("requests", "steps", "events", "snapshots")}

    before = counts()
    assert all(before[table].get(first.run_id) for table in before)
    RunLogReader(tmp_path / "runs.db", writable=True).delete(first.run_id)
    after = counts()
    for table in before:
        assert first.run_id not in after[table]
        assert after[table].get(second.run_id) == before[table].get(second.run_id)
    assert [r["id"] for r in db.query("SELECT id FROM runs")] == [second.run_id]


# --- the writer never holds up the engine --------------------------------------------


@pytest.mark.parametrize("bound", ["records", "bytes"])
def test_a_stalled_disk_drops_records_instead_of_blocking(tmp_path, monkeypatch, bound):
    engine = SyntheticEngine(64, max_running=4, seed=2)
    if bound == "records":
        monkeypatch.setattr(writer, "MAX_QUEUED_RECORDS", 5)
    else:   # room for five records of 1,000 bytes
        monkeypatch.setattr(writer, "record_bytes", lambda record: 1000)
        monkeypatch.setattr(writer, "MAX_QUEUED_BYTES", 5500)
    stalled, release = threading.Event(), threading.Event()
    real_write = writer.RunLogger._write

    def slow_write(self, rows_for, batch):
        stalled.set()
        release.wait()
        real_write(self, rows_for, batch)

    monkeypatch.setattr(writer.RunLogger, "_write", slow_write)
    logger = open_log(tmp_path / "runs.db")
    logger.step(engine.step())
    assert stalled.wait(10)
    caller = threading.Thread(target=lambda: [logger.step(engine.step()) for _ in range(20)])
    caller.start()
    caller.join(30)  # a put that blocked would hang here
    assert not caller.is_alive()
    assert logger.num_dropped_records == 20 - 5
    release.set()
    logger.close()
    reader = RunLogReader(tmp_path / "runs.db")
    assert len(reader.steps(logger.run_id)) == 1 + 5
    assert reader.run(logger.run_id)["num_dropped_records"] == 15
    assert len(list(reader.iter_snapshots(logger.run_id))) == 6


def test_a_queued_engine_step_is_counted_by_the_blocks_it_changed_not_by_the_pool():
    from kvscope.app.runlog.records import LoggedStep, record_bytes
    from kvscope.engine import LLMEngine, SamplingParams
    from kvscope.engine.fake_runner import FakeRunner

    config = EngineConfig(device="cpu", num_blocks=100_000)
    engine = LLMEngine(config, runner=FakeRunner(config, num_blocks=100_000, verify=False))
    engine.add_request([1] * 40, SamplingParams(max_tokens=8))
    engine.step()
    step = LoggedStep.of(engine.step())
    assert record_bytes(step) < 4096
    assert step.snapshot.block_state.size == 100_000   # a reader built the whole arrays: the record holds them
    assert record_bytes(step) > 100_000 * 15


def test_a_write_error_turns_logging_off_with_a_warning(tmp_path, monkeypatch):
    def failing_write(self, rows_for, batch):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(writer.RunLogger, "_write", failing_write)
    engine = SyntheticEngine(64, max_running=4, seed=2)
    logger = open_log(tmp_path / "runs.db")
    logger.step(engine.step())
    logger._thread.join(10)
    assert not logger.enabled
    assert "disk I/O error" in logger.warning and str(tmp_path / "runs.db") in logger.warning
    for _ in range(3):
        logger.step(engine.step())
    logger.close()


def test_close_is_idempotent_and_later_calls_are_ignored(tmp_path):
    logger, _, _ = log_synthetic_run(tmp_path / "runs.db", num_steps=10)
    logger.close("finished")
    logger.close("crashed")
    logger.step(SyntheticEngine(16).step())
    run = RunLogReader(tmp_path / "runs.db").run(logger.run_id)
    # "finished" with requests still running is recorded as interrupted; the later "crashed" is ignored.
    assert run["status"] == "interrupted" and run["num_steps"] == 10


def test_disabled_logger_does_nothing(tmp_path):
    logger = open_log(tmp_path / "runs.db", enabled=False)
    assert not logger.enabled and logger.warning is None and logger.run_id is None
    logger.request_added("a", "hi", 1, 1)
    logger.step(SyntheticEngine(16).step())
    logger.close()
    assert not (tmp_path / "runs.db").exists()


# --- faults: logging turns off with one clear line, nothing raises --------------------


def assert_disabled_but_harmless(logger, path, *words):
    assert not logger.enabled and logger.run_id is None
    assert "\n" not in logger.warning and str(path) in logger.warning
    for word in words:
        assert word in logger.warning
    engine = SyntheticEngine(32, max_running=2, seed=4)
    for _ in range(5):  # the engine loop carries on
        logger.step(engine.step())
    logger.close()


def test_missing_directories_are_created(tmp_path):
    logger = open_log(tmp_path / "a" / "b" / "runs.db")
    logger.close()
    assert logger.enabled and (tmp_path / "a" / "b" / "runs.db").is_file()


def test_a_directory_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    path = tmp_path / "file" / "sub" / "runs.db"
    assert_disabled_but_harmless(open_log(path), tmp_path / "file" / "sub", "--db", "--no-log")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_directory(tmp_path):
    locked_dir = tmp_path / "ro"
    locked_dir.mkdir()
    locked_dir.chmod(0o500)
    try:
        assert_disabled_but_harmless(open_log(locked_dir / "runs.db"), locked_dir / "runs.db", "writable")
    finally:
        locked_dir.chmod(0o700)


def test_a_path_that_cannot_be_opened(tmp_path):
    path = tmp_path / "runs.db"
    path.mkdir()  # a directory where the file should be: sqlite cannot open it, even as root
    assert_disabled_but_harmless(open_log(path), path, "cannot write", "--db")


def test_a_locked_database(tmp_path):
    path = tmp_path / "runs.db"
    open_log(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        assert_disabled_but_harmless(open_log(path), path, "locked")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert open_log(path).enabled


def test_a_corrupt_file_is_left_as_it_is(tmp_path):
    path = tmp_path / "runs.db"
    path.write_bytes(os.urandom(8192))
    before = file_digest(path)
    assert_disabled_but_harmless(open_log(path), path, "not a readable SQLite database", "move it aside")
    assert file_digest(path) == before


def test_a_newer_schema_is_refused_untouched(tmp_path):
    path = tmp_path / "runs.db"
    open_log(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    before = file_digest(path)
    newer = f"schema version {SCHEMA_VERSION + 1}"
    assert_disabled_but_harmless(open_log(path), path, "newer kvscope", newer)
    assert file_digest(path) == before
    with pytest.raises(schema.SchemaError, match="newer"):
        RunLogReader(path)


def test_another_programs_database_is_refused(tmp_path):
    path = tmp_path / "other.db"
    sqlite_utils.Database(path)["notes"].insert({"text": "mine"})
    before = file_digest(path)
    assert_disabled_but_harmless(open_log(path), path, "not a kvscope run log")
    assert file_digest(path) == before


# --- migrations ----------------------------------------------------------------------


def test_an_older_database_is_migrated_in_place(tmp_path, monkeypatch):
    path = tmp_path / "runs.db"
    old, _, _ = log_synthetic_run(path, num_steps=10)
    old.close()

    def add_notes(db):
        db["runs"].add_column("notes", str)

    monkeypatch.setattr(schema, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    monkeypatch.setitem(schema.MIGRATIONS, SCHEMA_VERSION + 1, add_notes)
    new = open_log(path)
    new.close()
    db = sqlite_utils.Database(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    assert "notes" in db["runs"].columns_dict
    assert len(RunLogReader(path).steps(old.run_id)) == 10


def test_an_empty_file_gets_the_schema(tmp_path):
    path = tmp_path / "runs.db"
    path.touch()
    logger = open_log(path)
    logger.close()
    assert logger.enabled
    assert sqlite_utils.Database(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


# --- crashed runs --------------------------------------------------------------------


def insert_running_run(path, pid, pid_started_at, hostname):
    db = sqlite_utils.Database(path)
    return db["runs"].insert({"started_at": "2026-01-01T00:00:00+00:00", "status": "running", "source": "app",
                              "pid": pid, "pid_started_at": pid_started_at, "hostname": hostname}).last_pk


def test_runs_of_dead_or_reused_pids_are_marked_crashed_live_ones_are_not(tmp_path):
    path = tmp_path / "runs.db"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    pid, started, host = current_process_identity()
    open_log(path).close()
    dead = insert_running_run(path, child.pid, started, host)
    reused = insert_running_run(path, pid, started - 1000, host)  # our pid, but another process's start
    alive = insert_running_run(path, pid, started, host)
    elsewhere = insert_running_run(path, child.pid, started, "another-host")
    assert {r["id"]: r["status"] for r in RunLogReader(path).list_runs()}[dead] == "crashed"  # read-only view
    assert sorted(mark_crashed_runs(sqlite_utils.Database(path))) == sorted([dead, reused])
    statuses = {r["id"]: r["status"] for r in sqlite_utils.Database(path)["runs"].rows}
    assert statuses[dead] == statuses[reused] == "crashed"
    assert statuses[alive] == statuses[elsewhere] == "running"
    open_log(path).close()  # opening a logger marks too, and leaves live runs alone
    assert sqlite_utils.Database(path)["runs"].get(alive)["status"] == "running"


def test_step_stats_round_trip_keeps_every_field(tmp_path):
    logger, results, _ = log_synthetic_run(tmp_path / "runs.db", num_steps=5)
    logger.close()
    stats = RunLogReader(tmp_path / "runs.db").steps(logger.run_id)
    assert all(isinstance(s, StepStats) for s in stats)
    assert [dataclasses.asdict(s) for s in stats] == [dataclasses.asdict(r.stats) for r in results]


def test_a_script_logs_its_engine_with_record_run(tmp_path):
    from kvscope.app.runlog import record_run
    from kvscope.engine import SamplingParams
    from kvscope.engine.fake_runner import fake_engine

    engine = fake_engine(EngineConfig(block_size=4), num_blocks=32, max_model_len=64)
    with record_run(engine, db_path=tmp_path / "runs.db") as log:
        outputs = engine.generate(["hello there", [70, 71, 72]],
                                  SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    reader = RunLogReader(tmp_path / "runs.db")
    run = reader.run(log.run_id)
    assert run["source"] == "script" and run["status"] == "finished"
    assert run["num_steps"] == engine.step_counter
    rows = {row["request_id"]: row for row in reader.rows("requests", log.run_id)}
    assert [rows[o.request_id]["output_text"] for o in outputs] == [o.text for o in outputs]
    assert rows[outputs[0].request_id]["prompt_text"] == "hello there"
    assert rows[outputs[1].request_id]["prompt_text"] == "FGH"     # token ids, decoded
    assert all(row["finish_reason"] == "length" for row in rows.values())


def test_a_script_that_raises_leaves_a_crashed_run(tmp_path):
    from kvscope.app.runlog import record_run
    from kvscope.engine.fake_runner import fake_engine

    engine = fake_engine(EngineConfig(block_size=4), num_blocks=32, max_model_len=64)
    db = tmp_path / "runs.db"
    with pytest.raises(RuntimeError, match="the script failed"), record_run(engine, db_path=db) as log:
        engine.step()
        raise RuntimeError("the script failed")
    assert RunLogReader(db).run(log.run_id)["status"] == "crashed"


def test_record_run_attaches_an_engine_observer_that_hears_every_request_and_step(tmp_path):
    from kvscope.app.runlog import record_run
    from kvscope.engine import EngineObserver, SamplingParams
    from kvscope.engine.fake_runner import fake_engine

    engine = fake_engine(EngineConfig(block_size=4), num_blocks=32, max_model_len=64)
    with record_run(engine, db_path=tmp_path / "runs.db") as log:
        assert engine.observers == [log] and isinstance(log, EngineObserver)
        engine.generate([[1, 2, 3], "hi"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    reader = RunLogReader(tmp_path / "runs.db")
    requests = reader.rows("requests", log.run_id)
    assert [(r["request_id"], r["num_prompt_tokens"]) for r in requests] == [("0", 3), ("1", 2)]
    assert len(reader.steps(log.run_id)) == engine.step_counter
    reader.close()


def test_record_run_with_a_bad_path_warns_and_the_engine_runs_on(tmp_path):
    from kvscope.app.runlog import record_run
    from kvscope.engine import SamplingParams
    from kvscope.engine.fake_runner import fake_engine

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    engine = fake_engine(EngineConfig(block_size=4), num_blocks=32, max_model_len=64)
    with record_run(engine, db_path=blocker / "runs.db") as log:
        (output,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert not log.enabled and str(blocker) in log.warning and engine.observers == []
    assert len(output.token_ids) == 3
