"""Block-map snapshots: keyframe + delta encoding, replay through the reader, and the size budget."""

from __future__ import annotations

import dataclasses
import sqlite3
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic_engine import SyntheticEngine

from kvscope.app.runlog import RunLogReader, RunNotFound, open_run_log
from kvscope.app.runlog.reader import CHECKPOINT_FRAMES, MAX_CHECKPOINTS
from kvscope.app.runlog.records import LoggedStep, RowBuilder, Rows, record_bytes
from kvscope.app.runlog.snapshots import (
    KEYFRAME_INTERVAL,
    MAX_KEYFRAME_INTERVAL,
    SnapshotDecoder,
    SnapshotEncoder,
    pack,
    unpack,
)
from kvscope.app.widgets.counters import describe_stats
from kvscope.engine import LLMEngine, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.engine.fake_runner import FakeRunner, fake_engine
from kvscope.engine.kv_cache_groups import KVCacheGroup
from kvscope.engine.outputs import CacheSnapshot, RequestView

ARRAYS = ("block_state", "ref_counts", "block_fill", "block_hashes")


def assert_same_snapshot(got: CacheSnapshot, expected: CacheSnapshot) -> None:
    for name in ARRAYS:
        want, have = getattr(expected, name), getattr(got, name)
        assert have.dtype == want.dtype and np.array_equal(have, want), name
        assert not have.flags.writeable
    for field in dataclasses.fields(CacheSnapshot):
        if field.name != "blocks":  # the arrays' source: compared through them above
            assert getattr(got, field.name) == getattr(expected, field.name), field.name


def random_snapshots(seed: int, num_frames: int, num_blocks: int) -> list[CacheSnapshot]:
    """Frames where anything may change: requests come, go, reorder, grow, shrink, swap and fork."""
    rng = np.random.default_rng(seed)
    views: dict[str, RequestView] = {}
    frames = []
    for step in range(num_frames):
        for request_id in list(views):
            if rng.random() < 0.2:
                del views[request_id]
        for index in range(int(rng.integers(0, 3))):
            request_id = f"r{step}-{index}"
            views[request_id] = RequestView(
                request_id, "waiting", len(views), ((),), ((),), int(rng.integers(1, 50)), 0,
                int(rng.integers(1, 20)), 0, 0, 0, 1, 0, 0, prompt_preview=f"hello {request_id}")
        for request_id, view in list(views.items()):
            roll = rng.random()
            if roll < 0.5:  # decode: counters move, the table may grow
                tables = tuple(t + (int(rng.integers(num_blocks)),) if rng.random() < 0.3 else t
                               for t in view.block_tables)
                view = view._replace(queue="running", block_tables=tables,
                                     num_output_tokens=view.num_output_tokens + 1,
                                     # now and then a prefill chunk: a difference no byte holds
                                     num_computed_tokens=view.num_computed_tokens + (7 if rng.random() < 0.9 else 700))
            elif roll < 0.6:  # preempted or swapped out: the table shrinks or moves to the host
                view = view._replace(queue=str(rng.choice(["waiting", "swapped"])),
                                     block_tables=((),) * len(view.block_tables),
                                     host_block_tables=(tuple(rng.integers(0, 9, 3).tolist()),),
                                     num_preemptions=view.num_preemptions + 1, num_computed_tokens=0)
            elif roll < 0.65:  # n > 1 forks its table
                view = view._replace(block_tables=view.block_tables * 2, num_samples=2)
            views[request_id] = view
        if rng.random() < 0.1:
            items = list(views.items())
            views = {items[i][0]: items[i][1] for i in rng.permutation(len(items))}
        arrays = (rng.integers(0, 3, num_blocks).astype(np.int8),
                  rng.integers(0, 4, num_blocks).astype(np.int32),
                  rng.integers(0, 17, num_blocks).astype(np.int16),
                  rng.choice(np.array([0, 1, 2**63 + 5, 2**64 - 1], dtype=np.uint64), num_blocks))
        if frames and rng.random() < 0.6:  # most steps change only a few blocks
            keep = rng.random(num_blocks) < 0.9
            arrays = tuple(np.where(keep, old, new) for old, new in zip(
                [getattr(frames[-1], a) for a in ARRAYS], arrays, strict=True))
        frames.append(CacheSnapshot(step, 16, num_blocks, "paged", *arrays, requests=tuple(views.values()),
                                    num_host_blocks=9, num_free_host_blocks=int(rng.integers(0, 10))))
    return frames


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_frames=st.integers(1, 40), num_blocks=st.integers(1, 64),
       keyframe_interval=st.integers(1, 12), keep_every=st.integers(1, 3))
def test_any_stream_of_snapshots_decodes_to_itself(seed, num_frames, num_blocks, keyframe_interval,
                                                   keep_every):
    # keep_every > 1 drops frames before encoding, as a writer that fell behind would.
    frames = random_snapshots(seed, num_frames, num_blocks)[::keep_every]
    encoder, decoder = SnapshotEncoder(keyframe_interval, max_keyframe_interval=keyframe_interval), SnapshotDecoder()
    keyframes = 0
    for frame in frames:
        keyframe, blob = encoder.encode(frame)
        keyframes += keyframe
        assert_same_snapshot(decoder.apply(blob), frame)
    assert keyframes == -(-len(frames) // keyframe_interval)


def one_block_a_step(num_blocks: int, num_frames: int, changed: int) -> list[CacheSnapshot]:
    """A pool of ``num_blocks`` whose first ``changed`` blocks fill by one slot a frame, the rest never change."""
    rng = np.random.default_rng(0)
    base = (np.ones(num_blocks, np.int8), np.ones(num_blocks, np.int32), rng.integers(1, 16, num_blocks, np.int16),
            np.zeros(num_blocks, np.uint64))
    frames = []
    for step in range(num_frames):
        fill = base[2].copy()
        fill[:changed] = (fill[:changed] + step) % 16
        frames.append(CacheSnapshot(step, 16, num_blocks, "paged", base[0], base[1], fill, base[3]))
    return frames


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(1, 400), least=st.integers(1, 6),
       most=st.integers(1, 30))
def test_a_keyframe_comes_once_the_deltas_since_hold_as_many_bytes_within_the_bounds(seed, num_blocks, least, most):
    """The rule, checked frame by frame on what each blob holds before compression."""
    most = max(least, most)
    encoder, decoder = SnapshotEncoder(least, max_keyframe_interval=most), SnapshotDecoder()
    keyframe_bytes = since_bytes = since_frames = 0
    for index, frame in enumerate(random_snapshots(seed, 60, num_blocks)):
        keyframe, blob = encoder.encode(frame)
        due = index == 0 or since_frames >= most or (since_frames >= least and since_bytes >= keyframe_bytes)
        assert keyframe == due, f"frame {index}"
        raw = len(zlib.decompress(blob))
        keyframe_bytes, since_bytes, since_frames = ((raw, 0, 1) if keyframe else
                                                     (keyframe_bytes, since_bytes + raw, since_frames + 1))
        assert_same_snapshot(decoder.apply(blob), frame)


def test_a_big_pool_that_changes_little_keyframes_at_the_longest_interval_and_a_busy_small_one_at_the_least():
    def keyframes(frames: list[CacheSnapshot]) -> list[int]:
        encoder = SnapshotEncoder()
        return [index for index, frame in enumerate(frames) if encoder.encode(frame)[0]]

    # 100,000 blocks (1.5 MB whole), a hundred changing a frame: the deltas never add up to a keyframe.
    assert keyframes(one_block_a_step(100_000, 1_001, 100)) == [0, MAX_KEYFRAME_INTERVAL, 2 * MAX_KEYFRAME_INTERVAL]
    # 64 blocks, every one changing: each delta holds more than the arrays whole.
    assert keyframes(one_block_a_step(64, 101, 64)) == [0, KEYFRAME_INTERVAL, 2 * KEYFRAME_INTERVAL]


def test_a_frame_whose_writer_named_its_counters_otherwise_decodes_the_same():
    """The decoder takes each frame's counters by the names it gives (a log from another kvscope may order them
    otherwise, or lack one), not by their place."""
    frames = random_snapshots(3, 6, 16)
    encoder, decoder = SnapshotEncoder(), SnapshotDecoder()
    for index, frame in enumerate(frames):
        keyframe, blob = encoder.encode(frame)
        header, arrays = unpack(blob)
        if not keyframe and "changed" in arrays:
            header["counters"] = header["counters"][::-1]
            arrays["counter_deltas"] = np.ascontiguousarray(arrays["counter_deltas"][:, ::-1])
            blob = pack(header, arrays)[0]
        assert_same_snapshot(decoder.apply(blob), frame), index


def test_a_pool_of_another_size_starts_a_keyframe():
    encoder = SnapshotEncoder(keyframe_interval=100)
    first, second = random_snapshots(1, 1, 8)[0], random_snapshots(2, 1, 16)[0]
    assert encoder.encode(first)[0] and not encoder.encode(first)[0]
    keyframe, blob = encoder.encode(second)
    assert keyframe
    assert_same_snapshot(SnapshotDecoder().apply(blob), second)


def test_a_stream_must_start_with_a_keyframe():
    encoder = SnapshotEncoder()
    frames = random_snapshots(3, 2, 8)
    encoder.encode(frames[0])
    _, delta = encoder.encode(frames[1])
    with pytest.raises(ValueError, match="keyframe"):
        SnapshotDecoder().apply(delta)


def test_decode_steps_store_only_what_changed():
    engine = SyntheticEngine(1024, max_running=64, arrivals_per_step=0.4, seed=5)
    encoder = SnapshotEncoder()
    for _ in range(200):
        keyframe, blob = encoder.encode(engine.step().snapshot)
    assert not keyframe
    header, arrays = unpack(blob)
    assert "block_state.at" not in arrays or arrays["block_state.at"].size < 64
    assert np.isin(arrays["counter_deltas"], [0, 1, 7, 16]).mean() > 0.9  # mostly +1s and zeros
    assert len(blob) < 2048


# --- through the logger and the reader -----------------------------------------------


def log_engine(path, engine, num_steps):
    # Steps first, then the log: the two threads do not fight over the GIL, so the test is quicker.
    results = [engine.step() for _ in range(num_steps)]
    config = EngineConfig(device="cpu", num_blocks=engine.num_blocks)
    logger = open_run_log(path, source="script", config=config, model="synthetic", device="cpu",
                          dtype="float32")
    for result in results:
        logger.step(result)
    logger.close()
    return logger.run_id, results


def test_replay_rebuilds_every_step_and_any_single_one(tmp_path):
    engine = SyntheticEngine(96, max_running=10, arrivals_per_step=0.7, seed=11)
    run_id, results = log_engine(tmp_path / "runs.db", engine, 140)
    reader = RunLogReader(tmp_path / "runs.db")
    frames = list(reader.iter_snapshots(run_id))
    assert [f.stats for f in frames] == [r.stats for r in results]
    for frame, result in zip(frames, results, strict=True):
        assert_same_snapshot(frame.snapshot, result.snapshot)
        assert frame.events == result.events
    assert reader.recorded_steps(run_id) == list(range(140))
    for step in (0, 1, 49, 50, 51, 99, 139):
        frame = reader.snapshot_at(run_id, step)
        assert frame.stats == results[step].stats
        assert_same_snapshot(frame.snapshot, results[step].snapshot)
    assert reader.snapshot_at(run_id, 10_000).stats.step == 139  # past the end: the last step
    with pytest.raises(RunNotFound):
        reader.snapshot_at(run_id, -1)
    with pytest.raises(RunNotFound):
        reader.snapshot_at(run_id + 1, 0)


def test_the_replay_cursor_steps_jumps_and_goes_back(tmp_path):
    engine = SyntheticEngine(64, max_running=8, arrivals_per_step=0.7, seed=12)
    run_id, results = log_engine(tmp_path / "runs.db", engine, 130)
    replay = RunLogReader(tmp_path / "runs.db").replay(run_id)
    assert replay.steps == list(range(130))
    for step in [*range(0, 12), 11, 60, 61, 129, 3, 49, 50, 100, 101, 102, 0]:
        frame = replay.frame(step)
        assert frame.stats == results[step].stats and frame.events == results[step].events
        assert_same_snapshot(frame.snapshot, results[step].snapshot)


def test_stepping_back_through_a_long_keyframe_span_decodes_from_the_nearest_checkpoint(tmp_path, monkeypatch):
    """A big pool that changes little keyframes hundreds of frames apart: every step back, from the end to the
    start, is the frame that was logged, and decodes at most CHECKPOINT_FRAMES frames once the span was read."""
    engine = SyntheticEngine(20_000, max_running=6, arrivals_per_step=0.5, seed=5)
    run_id, results = log_engine(tmp_path / "runs.db", engine, 260)
    replay = RunLogReader(tmp_path / "runs.db").replay(run_id)
    assert replay._keyframes == [0]
    decoded = []
    advance = SnapshotDecoder.advance
    monkeypatch.setattr(SnapshotDecoder, "advance", lambda decoder, blob: (decoded.append(1), advance(decoder, blob)))
    replay.frame(259)
    assert len(decoded) == 260
    for step in range(258, -1, -1):
        decoded.clear()
        frame = replay.frame(step)
        assert len(decoded) <= CHECKPOINT_FRAMES, step
        assert frame.stats == results[step].stats and frame.events == results[step].events
        assert_same_snapshot(frame.snapshot, results[step].snapshot)
    assert len(replay._checkpoints) <= MAX_CHECKPOINTS


@pytest.mark.parametrize("groups", [(), (KVCacheGroup((0,), None), KVCacheGroup((1,), 8))],
                         ids=["one group", "full and sliding groups"])
def test_a_real_engine_run_replays_exactly(tmp_path, groups):
    # The engine with its fake runner: swap preemption, prefix sharing, n=2 forks, evictions; with groups, each
    # request's per-group tables and the groups themselves replay too.
    scale = max(len(groups), 1)     # each group holds a block per block of tokens
    config = EngineConfig(device="cpu", num_blocks=48 * scale, block_size=4, preemption_mode="swap",
                          swap_space="1MiB")
    runner = FakeRunner(config, num_blocks=48 * scale, num_host_blocks=32 * scale, kv_cache_groups=groups)
    engine = LLMEngine(config, runner=runner)
    logger = open_run_log(tmp_path / "runs.db", source="script", config=config, model="fake", device="cpu",
                          dtype="float32")
    for i in range(12):
        prompt = "shared system prompt " + "x" * (3 * i)
        n = 2 if i % 3 == 0 else 1
        request_id = engine.add_request(prompt, SamplingParams(max_tokens=30, n=n, temperature=1.0, seed=i))
        logger.request_added(request_id, prompt, len(prompt), n)
    results = []
    while engine.has_unfinished_requests():
        results.append(engine.step())
        logger.step(results[-1])
    logger.close()

    reader = RunLogReader(tmp_path / "runs.db")
    frames = list(reader.iter_snapshots(logger.run_id))
    assert len(frames) == len(results)
    unrecorded = dict(schedule_duration=0.0, update_duration=0.0, snapshot_duration=0.0)  # phases: not logged
    for frame, result in zip(frames, results, strict=True):
        assert frame.stats == dataclasses.replace(result.stats, **unrecorded) and frame.events == result.events
        assert_same_snapshot(frame.snapshot, result.snapshot)
    if groups:  # the counters per group came back as they went in, and say something
        assert sum(frame.stats.window_freed_step[1] for frame in frames) == frames[-1].stats.window_freed_blocks[1] > 0
        # and the replay's counters panel says what the live one said
        assert [describe_stats(f.stats, None, f.snapshot.kv_cache_groups) for f in frames] == [
            describe_stats(r.stats, None, r.snapshot.kv_cache_groups) for r in results]
        assert "window freed" in describe_stats(frames[-1].stats, None, groups)
    else:
        assert all(frame.stats.group_held_blocks == () for frame in frames)
    run = reader.run(logger.run_id)
    assert {"preempt", "swap_out", "swap_in"} <= set(run["events"])
    assert run["num_requests"] == run["num_finished_requests"] == 12
    assert run["num_generated_tokens"] == run["num_output_tokens"] == 30 * (12 + 4)


def test_a_thousand_steps_over_1024_blocks_fit_the_size_budget(tmp_path):
    # The budget: 10,000 steps over 1024 blocks in < 50 MB, so < 5 MB per 1000 steps.
    engine = SyntheticEngine(1024, max_running=64, arrivals_per_step=0.35, seed=0)
    path = tmp_path / "runs.db"
    run_id, results = log_engine(path, engine, 1000)
    assert max(r.stats.kv_usage for r in results) > 0.5 and results[-1].stats.num_running > 20
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    size = path.stat().st_size
    print(f"run log: {size / 1e6:.2f} MB per 1000 steps over 1024 blocks")
    assert size < 5e6


def test_engine_frames_encode_from_the_engines_changes_and_decode_to_themselves():
    """Consecutive engine snapshots are encoded from the blocks each step changed, never building the pool's
    arrays; a skipped frame or a look between steps falls back to comparing arrays, and all decode exactly."""
    config = EngineConfig(device="cpu", num_blocks=64, block_size=4)
    engine = LLMEngine(config, runner=FakeRunner(config, num_blocks=64))
    for i in range(6):
        engine.add_request("prompt " + "y" * (5 * i), SamplingParams(max_tokens=20, n=1 + i % 2, seed=i))
    encoder, decoder = SnapshotEncoder(), SnapshotDecoder()
    step = 0
    built_on_delta = 0
    while engine.has_unfinished_requests():
        snapshot = engine.snapshot() if step % 7 == 3 else engine.step().snapshot
        step += 1
        if step % 5 == 0:
            continue    # a frame the writer dropped
        keyframe, blob = encoder.encode(snapshot)
        built_on_delta += not keyframe and snapshot.blocks._arrays is not None
        assert_same_snapshot(decoder.apply(blob), snapshot)
    assert step > 20 and built_on_delta < step // 3


def test_logging_a_step_builds_none_of_its_request_views():
    """The logger sizes a step and the writer encodes it from the running requests' captured columns: the views
    (a tuple per request) stay unbuilt until someone reads them, and then replay as encoded."""
    engine = fake_engine(EngineConfig(block_size=4, max_num_batched_tokens=64), num_blocks=64, max_model_len=64)
    for k in range(6):
        engine.add_request(list(range(k, k + 9)), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    encoder, decoder, builder = SnapshotEncoder(keyframe_interval=4), SnapshotDecoder(), RowBuilder(run_id=0)
    for _ in range(12):
        result = engine.step()
        snapshot = result.snapshot
        assert record_bytes(LoggedStep.of(result)) > 0 and snapshot.num_requests == 6
        builder.add(Rows(), LoggedStep.of(result))
        _, blob = encoder.encode(snapshot)
        assert snapshot._requests._views is None, "a view was built to log the step"
        assert_same_snapshot(decoder.apply(blob), snapshot)
