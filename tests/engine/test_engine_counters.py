"""Copy-on-write as an event (which block was copied to which, for which request) and the cumulative
counters of copy-on-write copies and evictions, checked against what the pool and the tables show."""

from __future__ import annotations

import sqlite3

import sqlite_utils
from invariants import check_invariants

from kvscope.app.runlog import RunLogReader, record_run
from kvscope.app.runlog.schema import MIGRATIONS, _create_v1
from kvscope.app.widgets.counters import describe_stats
from kvscope.app.widgets.event_line import narrate
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine


def test_each_copy_on_write_is_an_event_and_counted():
    engine = fake_engine(EngineConfig(block_size=16, num_blocks=32, max_model_len=256))
    engine.add_request([1] * 40, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3), request_id="r1")
    forked = engine.step()
    shared = forked.snapshot.requests[0].block_tables[0]
    assert forked.stats.num_copy_on_write_blocks == 0
    copied = engine.step()
    copies = [e for e in copied.events if e.kind == "copy_on_write"]
    assert len(copies) == 3 and {e.request_id for e in copies} == {"r1"}
    assert {e.blocks[0] for e in copies} == {shared[-1]}           # the shared partial block, every time
    tables = copied.snapshot.requests[0].block_tables
    assert {e.blocks[1] for e in copies} | {shared[-1]} == {table[2] for table in tables}
    assert sorted(e.detail for e in copies) == ["sample 0", "sample 1", "sample 2"]
    assert copied.stats.num_copy_on_write_blocks == 3
    check_invariants(engine)
    while engine.has_unfinished_requests():
        result = engine.step()
        assert not [e for e in result.events if e.kind == "copy_on_write"]   # nothing shared is written again
    assert result.stats.num_copy_on_write_blocks == 3


def test_evictions_are_counted_as_the_events_report_them():
    engine = fake_engine(EngineConfig(block_size=16, num_blocks=12, max_model_len=256))
    evicted, stats = 0, None
    for i in range(6):
        engine.add_request([10 + i] * 60, SamplingParams(max_tokens=4), request_id=f"r{i}")
        while engine.has_unfinished_requests():
            result = engine.step()
            evicted += sum(len(e.blocks) for e in result.events if e.kind == "evict")
            stats = result.stats
            check_invariants(engine)
    assert evicted > 0 and stats.num_evicted_blocks == evicted


def test_the_counters_are_logged_and_replayed_and_an_older_log_is_migrated(tmp_path):
    path = tmp_path / "runs.db"
    old = sqlite3.connect(path)      # a run log as the first schema wrote it
    _create_v1(sqlite_utils.Database(old))
    old.execute("PRAGMA user_version = 1")
    old.commit()
    old.close()
    engine = fake_engine(EngineConfig(block_size=16, num_blocks=32, max_model_len=256))
    with record_run(engine, db_path=path) as log:
        engine.add_request([1] * 40, SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=3))
        while engine.has_unfinished_requests():
            engine.step()
    reader = RunLogReader(path)
    assert reader.steps(log.run_id)[-1].num_copy_on_write_blocks == 3
    frame = reader.snapshot_at(log.run_id, 2)
    assert frame.stats.num_copy_on_write_blocks == 3
    assert sum(e.kind == "copy_on_write" for e in frame.events) == 3
    reader.close()


def test_the_copies_are_narrated_and_counted_on_screen():
    engine = fake_engine(EngineConfig(block_size=16, num_blocks=32, max_model_len=256))
    engine.add_request([1] * 40, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3), request_id="r1")
    forked = engine.step()
    copied = engine.step()
    pairs = [f"{e.blocks[0]}→{e.blocks[1]}" for e in copied.events if e.kind == "copy_on_write"]
    line = narrate(copied.stats, copied.events, copied.snapshot, forked.snapshot)
    assert f"copy-on-write {', '.join(pairs)}" in line
    assert "CoW/evicted  3 / 0 blocks" in describe_stats(copied.stats).splitlines()


def test_an_older_log_gains_the_run_label(tmp_path):
    path = tmp_path / "runs.db"
    old = sqlite3.connect(path)      # a run log as version 3 wrote it
    for version in (1, 2, 3):
        MIGRATIONS[version](sqlite_utils.Database(old))
    old.execute("PRAGMA user_version = 3")
    old.commit()
    old.close()
    engine = fake_engine(EngineConfig(block_size=16, num_blocks=32, max_model_len=256))
    with record_run(engine, db_path=path, source="lesson", label="sizing") as log:
        engine.add_request([1] * 20, SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
    reader = RunLogReader(path)
    assert reader.run(log.run_id)["label"] == "sizing" and reader.list_runs()[0]["label"] == "sizing"
    reader.close()
