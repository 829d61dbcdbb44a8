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
from kvscope.app.widgets.paged_vs_contiguous import AllocationComparison, PoolTotals, compare_allocations
from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.block_pool import NULL_BLOCK
from kvscope.engine.config import RequestError
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.kv_cache_groups import KVCacheGroup
from kvscope.engine.outputs import BLOCK_USED

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
    in_use = snapshot.block_state == BLOCK_USED
    assert aggregates.used_blocks() == int(in_use.sum())
    assert aggregates.used_tokens == int(snapshot.block_fill[in_use].sum())
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


def compared_over_every_entry(snapshot, max_model_len: int) -> AllocationComparison:
    """The paged-vs-contiguous figures by their definition: every table entry's fill, and the whole pool."""
    block_size, num_groups = snapshot.block_size, len(snapshot.kv_cache_groups) or 1
    per_table = np.array([int(snapshot.block_fill[list(table)].sum()) for view in snapshot.requests
                          for table in view.block_tables if table], dtype=np.int64)
    in_use = snapshot.block_state == BLOCK_USED
    if snapshot.allocator == "contiguous":
        paged_slots, paged_tokens = int((-(-per_table // block_size) * block_size).sum()), int(per_table.sum())
    else:
        paged_slots, paged_tokens = int(in_use.sum()) * block_size, int(snapshot.block_fill[in_use].sum())
    per_sequence = -(-max_model_len // block_size) * block_size * num_groups
    return AllocationComparison(per_table.size, int(per_table.sum()), per_table.size * per_sequence, paged_slots,
                                paged_tokens, per_sequence, num_groups)


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
            # The panel's figures from the requests' views and the map's counts equal their definition.
            expected = compared_over_every_entry(result.snapshot, 40)
            totals = PoolTotals(aggregates.used_blocks(), aggregates.used_tokens, aggregates.fill)
            assert compare_allocations(result.snapshot, 40, totals) == expected
            assert compare_allocations(result.snapshot, 40) == expected
