"""A step's running requests are captured as columns and their views built when read: read steps later, from
another thread or as columns, a snapshot still says what its own step saw."""

from __future__ import annotations

import threading

from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.outputs import RequestView
from kvscope.engine.request_columns import CapturedViews


def busy_engine(preemption_mode="recompute"):
    """Requests that outnumber the pool: they decode, cross blocks, are preempted, wait and finish."""
    engine = fake_engine(EngineConfig(block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                                      preemption_mode=preemption_mode),
                         num_blocks=24, max_model_len=64, num_host_blocks=32)
    for k in range(8):
        engine.add_request(list(range(10 * k, 10 * k + 5 + k)),
                           SamplingParams(max_tokens=6 + 3 * k, temperature=0.0, ignore_eos=True))
    return engine


def as_seen(engine) -> list[tuple]:
    """What the views of the requests in the queues must say now, read off the engine's own state."""
    scheduler = engine.scheduler
    return [(r.request_id, r.status, tuple(s.block_table for s in r.seqs), r.seqs[0].num_output_tokens,
             r.seqs[0].num_computed_tokens, r.num_preemptions)
            for queue in (scheduler.running, scheduler.swapped, scheduler.waiting) for r in queue]


def fields(view: RequestView) -> tuple:
    return (view.request_id, view.queue, view.block_tables, view.num_output_tokens, view.num_computed_tokens,
            view.num_preemptions)




def test_views_built_after_the_engine_moved_on_show_their_own_step():
    for mode in ("recompute", "swap"):
        engine = busy_engine(mode)
        kept = []
        while engine.has_unfinished_requests():
            result = engine.step()
            kept.append((result.snapshot, as_seen(engine)))
        assert any(isinstance(snapshot._requests, CapturedViews) for snapshot, _ in kept)
        assert sum(1 for _, seen in kept for entry in seen if entry[5]) > 0, "the workload never preempted"
        # Every request has finished and freed its blocks: the snapshots are read only now.
        for snapshot, seen in kept:
            assert [fields(view) for view in snapshot.requests] == seen
            check_columns(snapshot)


def test_columns_read_before_the_views_are_built_equal_the_views():
    engine = busy_engine()
    while engine.has_unfinished_requests():
        snapshot = engine.step().snapshot
        names = RequestView._fields
        before = snapshot.request_columns(names)
        assert before == [list(column) for column in zip(*snapshot.requests)] or not snapshot.requests
        assert snapshot.request_columns(names) == before


def test_threads_reading_one_snapshot_get_the_same_views():
    engine = busy_engine()
    for _ in range(4):
        engine.step()
    snapshot = engine.step().snapshot
    got = []
    readers = [threading.Thread(target=lambda: got.append(snapshot.requests)) for _ in range(4)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert len({id(views) for views in got}) == 1 and got[0]


def check_columns(snapshot) -> None:
    views = snapshot.requests
    for name in RequestView._fields:
        assert snapshot.request_columns((name,)) == [[getattr(view, name) for view in views]]
