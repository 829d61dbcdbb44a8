"""KVCacheManager: prefix hits, atomic allocation, copy-on-write, fork, swap and the contiguous allocator."""

from __future__ import annotations

import inspect

from kvscope.engine import kv_cache_manager
from kvscope.engine.config import SamplingParams
from kvscope.engine.kv_cache_manager import KVCacheManager, hash_block
from kvscope.engine.request import Request

BS = 4


def manager(num_blocks=16, num_host_blocks=0, **kwargs) -> KVCacheManager:
    kwargs.setdefault("max_model_len", 64)
    return KVCacheManager(num_blocks, num_host_blocks, BS, **kwargs)


def request(tokens, n=1, rid="r") -> Request:
    return Request(rid, list(tokens), SamplingParams(n=n, max_tokens=8, temperature=1.0), 0, 0.0)


def admit(kv: KVCacheManager, req: Request) -> bool:
    """Admit with prefix hits, compute the whole prompt in one go (as an unlimited budget would)."""
    seqs = req.schedulable_seqs()
    hits = {seq.index: kv.find_cached_prefix(seq) for seq in seqs}
    plan = [(seq, seq.num_tokens - len(hits[seq.index]) * BS) for seq in seqs]
    if not kv.allocate_for_admission(req, plan, hits):
        return False
    for seq, num_new in plan:
        seq.num_computed_tokens = len(hits[seq.index]) * BS
        commit(kv, seq, num_new)
    return True


def commit(kv: KVCacheManager, seq, num_new: int) -> None:
    """What the scheduler does with computed tokens: the cache records them, then the counter moves."""
    kv.commit(seq, seq.num_computed_tokens, num_new)
    seq.num_computed_tokens += num_new


def decode(kv: KVCacheManager, req: Request, token: int) -> bool:
    """Every live sample appends ``token`` and computes it."""
    seqs = req.schedulable_seqs()
    for seq in seqs:
        seq.token_ids.append(token)
    plan = [(seq, 1) for seq in seqs]
    if not kv.allocate_slots(req, plan):
        for seq in seqs:
            seq.token_ids.pop()
        return False
    for seq in seqs:
        commit(kv, seq, 1)
    return True


def fork(kv: KVCacheManager, req: Request) -> None:
    for child in req.seqs[1:]:
        child.num_computed_tokens = req.seqs[0].num_computed_tokens
        kv.fork(req.seqs[0], child)
    req.forked = True


def test_the_manager_moves_blocks_and_leaves_every_computed_count_to_the_scheduler():
    kv = manager()
    assert admit(kv, request(range(10), rid="a"))
    b = request(range(10), n=2, rid="b")
    seq = b.seqs[0]
    hits = {0: kv.find_cached_prefix(seq)}
    assert kv.allocate_for_admission(b, [(seq, 2)], hits) and len(seq.block_table) == 3
    kv.commit(seq, 8, 2)
    kv.fork(seq, b.seqs[1])
    assert [s.num_computed_tokens for s in b.seqs] == [0, 0]
    assert "num_computed_tokens =" not in inspect.getsource(kv_cache_manager)
    assert "num_computed_tokens +=" not in inspect.getsource(kv_cache_manager)


def test_block_hash_chain_depends_on_parent_and_content_and_is_never_zero():
    assert hash_block(0, (1, 2, 3, 4)) == hash_block(0, (1, 2, 3, 4)) != 0
    assert hash_block(0, (1, 2, 3, 4)) != hash_block(1, (1, 2, 3, 4))
    assert hash_block(0, (1, 2, 3, 4)) != hash_block(0, (1, 2, 3, 5))


def test_prefix_hit_reuses_full_blocks_and_never_the_partial_last_block():
    kv = manager()
    a = request(range(10), rid="a")             # 2 full blocks + 2 tokens
    assert admit(kv, a)
    assert len(kv.block_pool.cached_blocks) == 2
    b = request(range(10), rid="b")
    assert admit(kv, b)
    assert b.seqs[0].block_table[:2] == a.seqs[0].block_table[:2]
    assert b.seqs[0].block_table[2] != a.seqs[0].block_table[2]
    assert kv.block_pool.ref_counts[list(a.seqs[0].block_table)].tolist() == [2, 2, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)


def test_prefix_hit_is_capped_so_the_last_prompt_token_is_computed():
    kv = manager()
    assert admit(kv, request(range(8), rid="a"))    # exactly 2 full blocks, both cached
    b = request(range(8), rid="b")
    hits = kv.find_cached_prefix(b.seqs[0])
    assert len(hits) == 1                           # 4 tokens hit, 4 computed
    c = request(range(9), rid="c")
    assert len(kv.find_cached_prefix(c.seqs[0])) == 2   # 8 hit, the ninth computed


def test_prefix_hit_stops_at_the_first_different_block():
    kv = manager()
    assert admit(kv, request([1, 2, 3, 4, 5, 6, 7, 8, 9], rid="a"))
    b = request([1, 2, 3, 4, 5, 6, 7, 0, 9], rid="b")
    assert len(kv.find_cached_prefix(b.seqs[0])) == 1


def test_prefix_caching_off_finds_nothing_and_counts_nothing():
    kv = manager(enable_prefix_caching=False)
    assert admit(kv, request(range(12), rid="a"))
    assert admit(kv, request(range(12), rid="b"))
    assert kv.block_pool.cached_blocks == {} and kv.prefix_cache_queries == 0


def test_failed_admission_changes_nothing_not_even_the_hit_blocks():
    kv = manager(num_blocks=5)
    a = request(range(8), rid="a")
    assert admit(kv, a)
    kv.free_request(a)                              # 2 cached-free blocks
    holder = request([50, 51, 52, 53, 54, 55], rid="holder")
    assert admit(kv, holder)                        # holds 2 of the 3 plain blocks
    before = (kv.block_pool.ref_counts.copy(), list(kv.block_pool.free_block_queue),
              dict(kv.block_pool.cached_blocks), kv.prefix_cache_queries)
    b = request(range(16), rid="b")                 # hits 2 blocks, needs 2 more, 1 is left
    assert not admit(kv, b)
    assert (kv.block_pool.ref_counts.tolist(), list(kv.block_pool.free_block_queue),
            dict(kv.block_pool.cached_blocks), kv.prefix_cache_queries) == (before[0].tolist(), *before[1:])
    assert b.seqs[0].block_table == () and b.seqs[0].num_computed_tokens == 0
    kv.free_request(holder)
    assert admit(kv, b)
    assert kv.prefix_cache_hits == 8


def test_copy_on_write_copies_a_shared_partial_block_once_per_extra_sharer():
    kv = manager()
    req = request(range(6), n=3)        # 1 full block + 2 tokens
    assert admit(kv, req)
    fork(kv, req)
    full, partial = req.seqs[0].block_table
    assert kv.block_pool.ref_counts[[full, partial]].tolist() == [3, 3]
    assert decode(kv, req, 99)
    copies = kv.take_cache_moves()[2]
    assert [src for src, _ in copies] == [partial, partial]
    tables = [seq.block_table for seq in req.seqs]
    assert all(table[0] == full for table in tables)                    # full blocks stay shared
    assert sorted(t[1] for t in tables) == sorted([partial, *(dst for _, dst in copies)])
    assert tables[2][1] == partial                                      # the last writer keeps it
    assert kv.block_pool.ref_counts[[full, partial]].tolist() == [3, 1]
    assert all(kv.block_pool.fill[t[1]] == 3 for t in tables)
    assert decode(kv, req, 98)          # the blocks are private now: no more copies
    assert kv.take_cache_moves()[2] == ()


def test_copy_on_write_needs_a_free_block_and_fails_atomically():
    kv = manager(num_blocks=3)
    req = request(range(6), n=2)
    assert admit(kv, req)
    fork(kv, req)
    filler = request([7], rid="filler")
    assert admit(kv, filler)            # the last free block
    tables = [seq.block_table for seq in req.seqs]
    assert not decode(kv, req, 1)
    assert kv.take_cache_moves()[2] == ()
    assert kv.block_pool.ref_counts.tolist() == [2, 2, 1]
    assert [seq.block_table for seq in req.seqs] == tables


def test_contiguous_reserves_max_model_len_and_fork_copies_the_prompt():
    kv = manager(num_blocks=16, allocator="contiguous", max_model_len=16)
    req = request(range(6), n=2)
    assert admit(kv, req)
    assert [len(seq.block_table) for seq in req.seqs] == [4, 4]
    assert kv.block_pool.num_used_blocks == 8
    assert kv.copy_state().num_tokens_held == 6              # 32 slots reserved, 6 used
    fork(kv, req)
    copies = kv.take_cache_moves()[2]
    assert copies == tuple(zip(req.seqs[0].block_table[:2], req.seqs[1].block_table[:2], strict=True))
    assert kv.block_pool.ref_counts.max() == 1              # nothing shared
    assert decode(kv, req, 5) and kv.block_pool.num_used_blocks == 8
    assert kv.max_blocks_needed(6, 2, n=3) == 12


def test_paged_peak_blocks_count_no_sharing():
    kv = manager()
    assert kv.max_blocks_needed(num_prompt_tokens=6, max_tokens=3, n=1) == 2    # 8 tokens ever cached
    assert kv.max_blocks_needed(num_prompt_tokens=6, max_tokens=4, n=2) == 6


def test_swap_out_and_in_keep_sharing_and_ref_counts():
    kv = manager(num_blocks=8, num_host_blocks=8)
    req = request(range(6), n=2)
    assert admit(kv, req)
    fork(kv, req)
    assert decode(kv, req, 42)          # sample 0 now has a private copy of the partial block
    kv.take_cache_moves()
    assert kv.swap_out(req)
    out = kv.take_cache_moves()[0]
    assert len(out) == 3 and kv.num_swapped_out_blocks == 3
    assert kv.block_pool.num_used_blocks == 0
    host_tables = [seq.host_block_table for seq in req.seqs]
    assert host_tables[0][0] == host_tables[1][0]
    assert kv.host_pool.ref_counts[host_tables[0][0]] == 2
    plan = [(seq, 1) for seq in req.seqs]
    for seq in req.seqs:
        seq.token_ids.append(7)
    assert kv.swap_in(req, plan)
    swap_in = kv.take_cache_moves()[1]
    assert len(swap_in) == 3 and kv.num_swapped_in_blocks == 3
    assert kv.host_pool.num_free_blocks == 8
    assert req.seqs[0].block_table[0] == req.seqs[1].block_table[0]
    assert kv.block_pool.ref_counts[req.seqs[0].block_table[0]] == 2
    # Each moved block comes back to where its swap-out copy went.
    host_of = dict(out)
    device_of = {host: device for host, device in swap_in}
    assert {device_of[host_of[src]] for src in host_of} == {b for s in req.seqs for b in s.block_table}


def test_swap_out_fails_atomically_when_the_host_pool_is_short():
    kv = manager(num_blocks=8, num_host_blocks=1)
    req = request(range(6))
    assert admit(kv, req)
    table = req.seqs[0].block_table
    assert not kv.swap_out(req)
    assert req.seqs[0].block_table == table and kv.host_pool.num_free_blocks == 1
    assert kv.take_cache_moves() == ((), (), ())


def test_free_request_releases_tail_first():
    kv = manager(num_blocks=4)
    req = request(range(13))            # 3 full blocks + 1 token
    assert admit(kv, req)
    table = req.seqs[0].block_table
    kv.free_request(req)
    # The partial block goes to the front (nothing to keep); the cached ones tail first.
    assert list(kv.block_pool.free_block_queue) == [table[3], table[2], table[1], table[0]]
    assert kv.block_pool.num_cached_free_blocks == 3
