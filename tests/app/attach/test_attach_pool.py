"""The attach pool model: recorded runs, invariants after every batch, and random event streams."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_fakes import SHARED, recorded_payloads

from kvscope.app.attach.feed.events import BatchDecoder
from kvscope.app.attach.feed.pool import MAX_DIRTY_TREES, PoolModel
from kvscope.app.attach.feed.pool_view import PoolPicture, in_use_blocks
from kvscope.engine.outputs import BLOCK_USED


def check_invariants(pool: PoolModel) -> None:
    known = pool.tree_at >= 0
    assert pool.num_known_blocks == int(known.sum()) <= pool.num_blocks
    slots = np.array(sorted(pool.slot_of.values()), dtype=np.int64)
    assert np.array_equal(slots, np.flatnonzero(known))
    assert sum(t.num_blocks for t in pool.trees.values()) == pool.num_known_blocks
    counted = np.bincount(pool.tree_at[known], minlength=max(pool.trees, default=0) + 1)
    for tree_id, stats in pool.trees.items():
        assert counted[tree_id] == stats.num_blocks > 0
        assert pool.tree_row_ids[stats.row] == tree_id and pool.tree_row_sizes[stats.row] == stats.num_blocks
    rows = pool.tree_rows_used
    assert int((pool.tree_row_ids[:rows] >= 0).sum()) == len(pool.trees)
    assert not pool.tree_row_sizes[:rows][pool.tree_row_ids[:rows] < 0].any()
    # A live child points at its live parent of the same tree, one level up; children counts agree.
    children = np.zeros(pool.num_blocks, dtype=np.int64)
    for slot in np.flatnonzero(known):
        parent = pool.parent_at[slot]
        if parent >= 0 and pool.generation_at[parent] == pool.parent_generation_at[slot]:
            assert pool.tree_at[parent] == pool.tree_at[slot]
            assert pool.depth_at[parent] == pool.depth_at[slot] - 1
            children[parent] += 1
    assert np.array_equal(children[known], pool.children_at[known])
    assert not pool.hash_at[~known].any() and pool.hash_at[known].all()


def replay(path, pool: PoolModel, after_each=None) -> None:
    decoder = BatchDecoder()
    for payload in recorded_payloads(path):
        pool.apply(decoder.decode(payload).events)
        if after_each:
            after_each(pool)


def test_the_recorded_run_never_exceeds_the_pool_and_every_removal_was_known():
    pool = PoolModel(96, 32)
    peak = []
    replay(SHARED / "kv-events.frames.jsonl", pool, lambda p: (check_invariants(p), peak.append(p.num_known_blocks)))
    counters = pool.counters
    assert max(peak) == 95          # the whole pool but vLLM's null block
    assert counters.num_unknown_removed == 0 and counters.num_overflow == 0
    # vLLM announced the 20 shared-prompt blocks a second time when a request reused them.
    assert counters.num_duplicates == 20
    assert pool.num_known_blocks == counters.num_stored - counters.num_duplicates - counters.num_removed == 94


def test_all_blocks_cleared_empties_the_pool_and_the_next_request_starts_a_tree():
    pool = PoolModel(96, 32)
    decoder = BatchDecoder()
    payloads = recorded_payloads(SHARED / "run2" / "kv-events.frames.jsonl")
    for payload in payloads[:3]:
        pool.apply(decoder.decode(payload).events)
    assert pool.num_known_blocks == 22
    batch = decoder.decode(payloads[3])
    pool.apply(batch.events[:1])
    assert pool.num_known_blocks == 0 and not pool.trees and pool.counters.num_cleared == 1
    pool.apply(batch.events[1:])
    check_invariants(pool)
    assert pool.num_known_blocks == 20 and len(pool.trees) == 1
    assert pool.slot_of[batch.events[1].block_hashes[0]] == 0   # slots are handed out from the start again


def test_slots_are_stable_and_reused_lowest_first():
    pool = PoolModel(8, 2)
    pool.store([1, 2, 3], None, [10, 11, 12, 13, 14, 15])
    pool.store([4], 3, [16, 17])
    assert [pool.slot_of[h] for h in (1, 2, 3, 4)] == [0, 1, 2, 3]
    pool.remove([2])
    pool.store([9], None, [1, 1])
    assert pool.slot_of[9] == 1 and pool.slot_of[4] == 3
    check_invariants(pool)


def test_prefix_trees_branches_reuse_and_preview():
    pool = PoolModel(16, 2)
    pool.store([1, 2], None, [5, 6, 7, 8])        # a shared prompt of two blocks
    pool.store([3], 2, [9, 9])                    # request A goes on
    pool.store([4], 2, [8, 8])                    # request B forks after the prompt: reuse
    pool.store([1, 2], None, [5, 6, 7, 8])        # vLLM re-announces the prompt a request hit: reuse
    pool.store([6], 99, [3, 3])                   # a parent evicted before kvscope saw it: a partial tree
    view = PoolPicture(pool, "rank 0", lambda ids: " ".join(map(str, ids))).view(1, None)
    shared, partial = view.trees
    assert (shared.num_blocks, shared.depth, shared.num_branches, shared.num_reuses) == (4, 3, 2, 2)
    assert shared.preview_token_ids == (5, 6, 7, 8, 9, 9) and shared.preview == "5 6 7 8 9 9"
    assert partial.partial and partial.num_blocks == 1
    assert view.snapshot.requests[0].block_tables == ((0, 1, 2, 3),)
    assert view.snapshot.requests[0].queue == "prefix"


def test_the_usage_band_fills_the_highest_free_slots():
    pool = PoolModel(11, 4)
    pool.store([1, 2], None, list(range(8)))
    view = PoolPicture(pool, "rank 0").view(3, kv_usage=0.5)       # 5 of the 10 usable blocks in use
    assert in_use_blocks(0.5, 11) == view.num_in_use_blocks == 5
    assert view.num_unannounced_blocks == 3
    state, fill = view.snapshot.block_state, view.snapshot.block_fill
    assert np.flatnonzero(state == BLOCK_USED).tolist() == [0, 1, 8, 9, 10]
    assert fill.tolist() == [4, 4] + [0] * 9
    assert not view.snapshot.block_state.flags.writeable
    idle = PoolPicture(pool, "rank 0").view(4, kv_usage=0.0)
    assert idle.num_unannounced_blocks == 0 and idle.num_cached_free_at_least == 2


def test_stores_beyond_the_pool_are_counted_not_kept():
    pool = PoolModel(2, 1)
    pool.store([1, 2, 3], None, [1, 2, 3])
    assert pool.num_known_blocks == 2 and pool.counters.num_overflow == 1
    pool.remove([7])
    assert pool.counters.num_unknown_removed == 1
    check_invariants(pool)


def test_the_journal_names_slots_and_counts():
    pool = PoolModel(8, 1)
    pool.store([1, 2], None, [1, 2])
    pool.remove([1])
    journal = pool.take_journal()
    assert (journal.stored_slots, journal.removed_slots, journal.num_stored, journal.num_removed) == \
           ((0, 1), (0,), 2, 1)
    assert pool.take_journal().empty


events = st.lists(st.one_of(
    st.tuples(st.just("store"), st.lists(st.integers(1, 40), min_size=1, max_size=4),
              st.one_of(st.none(), st.integers(1, 40))),
    st.tuples(st.just("remove"), st.lists(st.integers(1, 40), min_size=1, max_size=3), st.none()),
    st.tuples(st.just("clear"), st.just([]), st.none()),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(events)
def test_random_streams_keep_the_model_consistent(stream):
    pool = PoolModel(24, 1)
    known: set[int] = set()   # a reference: the hashes vLLM would hold, within the pool
    for kind, hashes, parent in stream:
        if kind == "store":
            pool.store(hashes, parent, list(hashes))
            for h in hashes:
                if h not in known and len(known) < 24:
                    known.add(h)
        elif kind == "remove":
            pool.remove(hashes)
            known.difference_update(hashes)
        else:
            pool.clear()
            known.clear()
        check_invariants(pool)
        assert set(pool.slot_of) == known
    PoolPicture(pool, "rank 0").view(0, 0.3)


def test_a_band_wider_than_the_untouched_slots_takes_the_highest_holes():
    pool = PoolModel(6, 1)
    pool.store([1, 2, 3, 4, 5], None, [1, 2, 3, 4, 5])
    pool.remove([2, 3])
    view = PoolPicture(pool, "rank 0").view(0, kv_usage=1.0)     # 5 of the 5 usable blocks in use
    assert view.num_unannounced_blocks == 2
    assert np.flatnonzero(view.snapshot.block_state == BLOCK_USED).tolist() == [0, 2, 3, 4, 5]
    assert view.snapshot.block_hashes[[1, 2, 5]].tolist() == [0, 0, 0]


def test_changes_nobody_looks_at_stay_bounded_and_the_next_picture_is_whole():
    pool = PoolModel(4, 1)
    picture = PoolPicture(pool, "rank 0")
    picture.view(0, None)
    for block_hash in range(1, MAX_DIRTY_TREES + 200):      # each store a new tree, evicted later
        pool.store([block_hash], None, [block_hash])
        if block_hash > 3:
            pool.remove([block_hash - 3])
    assert len(pool.dirty_trees) <= MAX_DIRTY_TREES and pool.all_dirty
    view = picture.view(1, None)
    assert sorted(v.request_id for v in view.snapshot.requests) == sorted(f"prefix-{t}" for t in pool.trees)
    assert {b for v in view.snapshot.requests for b in v.block_tables[0]} == set(pool.slot_of.values())
