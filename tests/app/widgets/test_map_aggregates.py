"""The block map's counts, kept from each step's block changes and each table's differences, equal a full recount
of the snapshot after random workloads (sharing, n > 1, aborts, preemption by recompute and by swap)."""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.app.widgets import block_cells as cells
from kvscope.app.widgets.group_kinds import kind_of_group
from kvscope.app.widgets.map_aggregates import (
    KIND_USED,
    NUM_KINDS,
    MapAggregates,
    first_in_use,
    kinds_of,
    owners_recounted,
)
from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.block_pool import NULL_BLOCK
from kvscope.engine.config import RequestError
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.kv_cache_groups import KVCacheGroup

# Two kinds (full, a window of 4 tokens), and one (a window on every layer).
FULL_AND_SLIDING = (KVCacheGroup((0,), None), KVCacheGroup((1,), 4))
SLIDING_ONLY = (KVCacheGroup((0, 1), 4),)


def assert_recounted(aggregates: MapAggregates, snapshot) -> None:
    """Every per-block copy and per-cell count against the snapshot's own arrays and tables."""
    n, width = snapshot.num_blocks, aggregates.blocks_per_cell
    assert np.array_equal(aggregates.state[:n], snapshot.block_state)
    assert np.array_equal(aggregates.refs[:n], snapshot.ref_counts)
    assert np.array_equal(aggregates.fill[:n], snapshot.block_fill)
    kinds = np.zeros(aggregates.num_cells * width, dtype=np.int8)
    kinds[:n] = kinds_of(snapshot.block_state, snapshot.ref_counts)
    assert np.array_equal(aggregates.kind, kinds)
    rows = kinds.reshape(-1, width)
    counts = np.stack([(rows == kind).sum(axis=1) for kind in range(NUM_KINDS)], axis=1)
    assert np.array_equal(aggregates.counts, counts)
    first = np.array([next((i for i, k in enumerate(row) if k >= KIND_USED), width) for row in rows])
    assert np.array_equal(aggregates.first_used, first)
    assert np.array_equal(first_in_use(rows, width), first)
    assert np.array_equal(aggregates.owner[:n], owners_recounted(snapshot))
    if snapshot.kv_cache_groups:     # each held block counted once, under its group's attention kind
        kind_of = kind_of_group(snapshot.kv_cache_groups)
        held_kind = np.full(aggregates.num_cells * width, -1)
        for view in snapshot.requests:
            for tables in view.group_block_tables:
                for group, table in enumerate(tables):
                    held_kind[[b for b in table if b != NULL_BLOCK]] = kind_of[group]
        expected = np.stack([(held_kind.reshape(-1, width) == k).sum(axis=1)
                             for k in range(aggregates.num_kinds)], axis=1)
        assert np.array_equal(aggregates.kind_counts, expected)
        for k in range(aggregates.num_kinds):
            assert np.array_equal(aggregates.cells_of_kind(k), np.flatnonzero(expected[:, k]))
    layout = cells.MapLayout(n, 8, 1, width)
    assert np.array_equal(cells.codes(cells.pool_cells(aggregates), snapshot.block_size),
                          cells.cell_codes(snapshot, layout))


@st.composite
def workloads(draw):
    config = EngineConfig(block_size=draw(st.sampled_from([1, 2, 4])), max_num_batched_tokens=draw(st.integers(4, 32)),
                          max_num_seqs=draw(st.integers(2, 6)), enable_prefix_caching=draw(st.booleans()),
                          preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
                          allocator=draw(st.sampled_from(["paged", "paged", "contiguous"])))
    prefixes = draw(st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=16), min_size=1, max_size=2))
    requests = draw(st.lists(st.tuples(
        st.integers(0, 6),                                        # arrival step
        st.sampled_from(prefixes), st.lists(st.integers(0, 255), max_size=6),
        st.integers(1, 3),                                        # samples
        st.integers(1, 10),                                       # max tokens
        st.one_of(st.none(), st.integers(0, 8))), min_size=1, max_size=7))   # aborted after that many steps
    # Per step: whether a frame is drawn, and whether the steps' changes since the last one were kept.
    frames = draw(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=40, max_size=40))
    groups = draw(st.sampled_from([(), FULL_AND_SLIDING, SLIDING_ONLY]))
    return config, draw(st.integers(14, 40)), draw(st.integers(1, 5)), requests, frames, groups


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_the_maps_counts_equal_a_full_recount_after_random_steps(workload):
    config, num_blocks, blocks_per_cell, requests, frames, groups = workload
    engine = fake_engine(config, num_blocks=num_blocks, num_host_blocks=16, max_model_len=40, kv_cache_groups=groups)
    aggregates = MapAggregates(num_blocks, blocks_per_cell)
    kept, added = [], {}
    for step, (drawn, keep) in enumerate(frames):
        for index, (arrival, prefix, suffix, n, max_tokens, abort_after) in enumerate(requests):
            if arrival == step:
                params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=index, ignore_eos=True)
                with contextlib.suppress(RequestError):    # a request the pool can never hold is refused
                    added[index] = engine.add_request((prefix + suffix)[:24], params)
            if abort_after is not None and index in added and step == arrival + abort_after:
                engine.abort_request(added[index])
        result = engine.step()
        if keep:      # a window keeps every step's changes; one that lost some reads the pool once
            kept.append(result.snapshot.blocks)
        if drawn:
            aggregates.update(result.snapshot, kept)
            kept = []
            assert_recounted(aggregates, result.snapshot)
