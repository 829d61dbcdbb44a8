"""BlockPool: ref counts, the free queue's eviction order and the prefix-cache map."""

from __future__ import annotations

import pytest

from kvscope.engine.block_pool import BlockPool
from kvscope.engine.outputs import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED, AllBlocksCleared, BlockRemoved, BlockStored


def register(pool: BlockPool, block: int, block_hash: int) -> None:
    pool.register(block, block_hash, None, [block] * pool.block_size)


def fill_and_register(pool: BlockPool, blocks, first_hash: int) -> None:
    for offset, block in enumerate(blocks):
        pool.fill[block] = pool.block_size
        register(pool, block, first_hash + offset)


def test_allocate_takes_blocks_in_order_and_marks_them_used():
    pool = BlockPool(8, 4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_counts.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert pool.state.tolist()[:4] == [BLOCK_USED, BLOCK_USED, BLOCK_USED, BLOCK_FREE]
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3


def test_allocate_more_than_free_raises_without_taking_anything():
    pool = BlockPool(2, 4)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_plain_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    fill_and_register(pool, a, 100)
    b = pool.allocate(2)
    pool.free(reversed(a))      # cached: to the back of the queue
    pool.free(reversed(b))      # plain: to the front
    assert pool.num_cached_free_blocks == 2
    assert pool.state.tolist() == [BLOCK_CACHED, BLOCK_CACHED, BLOCK_FREE, BLOCK_FREE]
    assert pool.allocate(2) == [2, 3]
    assert pool.cached_blocks == {100: 0, 101: 1}


def test_eviction_is_least_recently_freed_first_and_tail_first_within_a_request():
    pool = BlockPool(6, 4)
    first, second = pool.allocate(3), pool.allocate(3)
    fill_and_register(pool, first, 10)
    fill_and_register(pool, second, 20)
    pool.free(reversed(first))      # freed earlier: evicted first, its last block before its first
    pool.free(reversed(second))
    pool.take_events()
    assert pool.allocate(4) == [2, 1, 0, 5]
    assert pool.take_events() == [BlockRemoved(12, 2), BlockRemoved(11, 1), BlockRemoved(10, 0),
                                  BlockRemoved(22, 5)]
    assert pool.cached_blocks == {20: 3, 21: 4}
    assert pool.hashes.tolist() == [0, 0, 0, 20, 21, 0]
    assert pool.num_cached_free_blocks == 2


def test_a_hit_takes_a_cached_block_out_of_the_free_queue():
    pool = BlockPool(3, 4)
    blocks = pool.allocate(2)
    fill_and_register(pool, blocks, 7)
    pool.free(reversed(blocks))
    pool.touch([pool.lookup(7)])
    assert pool.ref_counts.tolist() == [1, 0, 0]
    assert pool.state[0] == BLOCK_USED
    assert 0 not in pool.free_block_queue
    assert pool.num_cached_free_blocks == 1
    pool.touch([0])                 # a second request sharing it
    assert pool.ref_counts[0] == 2
    pool.free([0])
    pool.free([0])
    # Re-freed after the hit, it is now the most recently used cached block.
    assert list(pool.free_block_queue) == [2, 1, 0]


def test_register_keeps_the_first_block_for_a_prefix():
    pool = BlockPool(2, 4)
    a, b = pool.allocate(2)
    pool.fill[[a, b]] = 4
    register(pool, a, 5)
    register(pool, b, 5)    # the same content computed twice: b stays uncached
    register(pool, a, 6)    # a block holds one prefix
    assert pool.cached_blocks == {5: a}
    assert pool.hashes.tolist() == [5, 0]
    assert pool.take_events() == [BlockStored(5, None, (a,) * 4, 4, a)]   # one event: what was cached


def test_freeing_a_shared_block_needs_every_reference_dropped():
    pool = BlockPool(2, 4)
    (block,) = pool.allocate(1)
    pool.incref([block])
    pool.free([block])
    assert pool.ref_counts[block] == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert pool.ref_counts[block] == 0 and pool.num_free_blocks == 2
    assert pool.fill[block] == 0


def test_every_change_to_the_prefix_cache_is_queued_until_taken():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(2)
    pool.fill[[a, b]] = 2
    pool.register(a, 7, None, [1, 2])
    pool.register(b, 8, 7, (3, 4))
    pool.free([b, a])
    assert pool.take_events() == [BlockStored(7, None, (1, 2), 2, a), BlockStored(8, 7, (3, 4), 2, b)]
    assert pool.take_events() == ()             # taken: the queue starts again
    pool.allocate(2)                            # the plain free block, then the least recently freed cached one
    assert pool.take_events() == [BlockRemoved(8, b)]
    assert pool.cached_blocks == {7: a}


def test_reset_prefix_cache_waits_for_every_block_to_be_free_then_drops_every_prefix():
    pool = BlockPool(3, 2)
    blocks = pool.allocate(2)
    fill_and_register(pool, blocks, 40)
    pool.take_events()
    assert not pool.reset_prefix_cache()        # in use: nothing changes
    assert pool.cached_blocks == {40: 0, 41: 1} and pool.take_events() == ()
    pool.free(reversed(blocks))
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_blocks == {} and not pool.hashes.any() and not pool.fill.any()
    assert pool.state.tolist() == [BLOCK_FREE] * 3 and pool.num_cached_free_blocks == 0


def test_rebuild_after_a_failed_step_reports_the_prefixes_it_forgets():
    pool = BlockPool(3, 2)
    kept, dropped, shared = pool.allocate(3)
    fill_and_register(pool, [kept, dropped, shared], 50)
    pool.take_events()
    pool.rebuild([(kept, shared)], forget={dropped, shared})    # shared is still held: it keeps its prefix
    assert pool.take_events() == [BlockRemoved(51, dropped)]
    assert pool.cached_blocks == {50: kept, 52: shared}


def test_changes_nobody_takes_stop_being_listed_and_read_as_all():
    pool = BlockPool(8, 4)
    for _ in range(2000):
        pool.free(pool.allocate(4))
    assert pool.changed is None and pool.take_changes() is None
    blocks = pool.allocate(2)
    assert pool.take_changes().tolist() == sorted(blocks) and pool.take_changes().tolist() == []
