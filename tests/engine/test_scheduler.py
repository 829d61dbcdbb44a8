"""Scheduler scenarios with exact numbers, run end to end on the fake runner (KV reads verified)."""

from __future__ import annotations

from invariants import check_invariants, record_batches, run_checked

from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(num_blocks=64, num_host_blocks=0, max_model_len=64, **config):
    config.setdefault("block_size", 4)
    engine = fake_engine(EngineConfig(**config), num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                         max_model_len=max_model_len)
    return engine, record_batches(engine)


def step(engine):
    result = engine.step()
    check_invariants(engine, result)
    return result


def params(max_tokens=8, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def test_long_prompt_is_chunked_within_the_budget():
    engine, batches = make_engine(max_num_batched_tokens=8)
    engine.add_request(list(range(20)), params(2))
    for _ in range(3):
        step(engine)
    assert [[(i.start_pos, len(i.token_ids), i.sample_indices) for i in b.items] for b in batches] == [
        [(0, 8, ())], [(8, 8, ())], [(16, 4, (0,))]]
    assert [b.num_prefill_tokens for b in batches] == [8, 8, 4]


def test_prefill_chunks_take_what_the_decodes_leave():
    engine, batches = make_engine(max_num_batched_tokens=8)
    engine.add_request([1, 2, 3], params(20), request_id="old")
    step(engine)
    engine.add_request(list(range(20)), params(2), request_id="long")
    for _ in range(3):
        step(engine)
    mixed = batches[1:]
    assert [b.num_decode_tokens for b in mixed] == [1, 1, 1]
    assert [b.num_prefill_tokens for b in mixed] == [7, 7, 6]
    assert [b.items[0].request_id for b in mixed] == ["old"] * 3


def test_short_budget_serves_the_oldest_running_requests_first():
    engine, batches = make_engine(max_num_batched_tokens=16)
    for name in "abc":
        engine.add_request([1, 2], params(8), request_id=name)
    step(engine)
    engine.scheduler.max_num_batched_tokens = 2
    step(engine)
    assert [i.request_id for i in batches[-1].items] == ["a", "b"]


def test_victim_is_the_most_recent_arrival_not_the_one_short_of_blocks():
    engine, batches = make_engine(num_blocks=4, max_num_batched_tokens=16)
    engine.add_request([1, 2, 3, 4], params(), request_id="a")
    engine.add_request([5, 6, 7], params(), request_id="b")
    engine.add_request([8, 9, 10], params(), request_id="c")
    step(engine)                # 3 blocks used
    step(engine)                # a's first decode takes the last block
    assert engine.scheduler.kv.block_pool.num_free_blocks == 0
    c = engine.scheduler.requests["c"]
    c_block = c.seqs[0].block_table[0]
    result = step(engine)       # b needs a block: c, the newest, makes room
    assert batches[-1].preempted_request_ids == ("c",)
    assert [i.request_id for i in batches[-1].items] == ["a", "b"]
    # c's full block stayed cached after the preemption, until b's allocation evicted it.
    assert [(e.kind, e.request_id, e.blocks) for e in result.events] == [
        ("preempt", "c", (c_block,)), ("evict", "b", (c_block,))]
    assert list(engine.scheduler.waiting) == [c]
    assert c.num_preemptions == 1 and result.stats.num_preemptions == 1
    assert c.seqs[0].num_computed_tokens == 0 and c.seqs[0].num_output_tokens == 2    # tokens kept


def test_recompute_victim_goes_to_the_front_of_waiting_and_nothing_is_admitted_that_step():
    engine, batches = make_engine(num_blocks=4, max_num_batched_tokens=16)
    for name, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7]), ("c", [8, 9, 10])):
        engine.add_request(prompt, params(), request_id=name)
    step(engine)
    step(engine)
    engine.add_request([11], params(), request_id="late")
    step(engine)
    assert [r.request_id for r in engine.scheduler.waiting] == ["c", "late"]
    assert {i.request_id for i in batches[-1].items} == {"a", "b"}


def three_in_a_swapping_pool():
    """a, b and c (4, 3 and 3 prompt tokens, 6 to generate) in 4 device blocks and 8 host blocks: by the third
    step c is swapped out, b later."""
    engine, batches = make_engine(num_blocks=4, num_host_blocks=8, preemption_mode="swap",
                                  max_num_batched_tokens=16)
    for name, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7]), ("c", [8, 9, 10])):
        engine.add_request(prompt, params(6), request_id=name)
    return engine, batches


def test_swap_mode_moves_the_victim_to_swapped_and_brings_it_back():
    engine, batches = three_in_a_swapping_pool()
    step(engine)
    step(engine)
    result = step(engine)
    c = engine.scheduler.requests["c"]
    assert engine.scheduler.swapped == [c]
    assert [e.kind for e in result.events] == ["preempt", "swap_out", "evict"]
    assert len(batches[-1].blocks_to_swap_out) == 1 and result.stats.num_swapped_out_blocks == 1
    assert c.seqs[0].num_computed_tokens == 4 and len(c.seqs[0].host_block_table) == 1
    swapped_in = []
    outputs = run_checked(engine, on_step=lambda r: swapped_in.extend(e for e in r.events
                                                                      if e.kind == "swap_in"))
    assert [e.request_id for e in swapped_in] == ["b", "c"]     # b was swapped out later; oldest back first
    assert any(b.blocks_to_swap_in for b in batches)
    reference = make_engine(num_blocks=64)[0].generate([[1, 2, 3, 4], [5, 6, 7], [8, 9, 10]], params(6))
    final = {o.request_id: o for o in outputs if o.finished}
    assert [final[r].token_ids for r in "abc"] == [o.token_ids for o in reference]


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    engine, batches = make_engine(num_blocks=4, num_host_blocks=1, preemption_mode="swap",
                                  max_num_batched_tokens=16)
    engine.add_request([1, 2, 3, 4], params(), request_id="a")
    engine.add_request([5, 6, 7], params(), request_id="b")
    engine.add_request([8, 9, 10, 11, 12], params(), request_id="c")    # 2 blocks: more than the host pool
    step(engine)
    result = step(engine)       # a needs a block; c (2 blocks) cannot be swapped into 1 host block
    assert batches[-1].preempted_request_ids == ("c",)
    assert [(e.kind, e.detail) for e in result.events] == [("preempt", "recompute (host pool full)")]
    assert [r.request_id for r in engine.scheduler.waiting] == ["c"] and not engine.scheduler.swapped
    assert batches[-1].blocks_to_swap_out == ()
    run_checked(engine)


def test_swapped_requests_come_back_before_waiting_ones_are_admitted():
    engine, batches = three_in_a_swapping_pool()
    step(engine)
    step(engine)
    step(engine)                # c swapped out
    engine.add_request([1], params(1), request_id="late")
    order = []
    run_checked(engine, on_step=lambda r: order.extend(
        e.request_id for e in r.events if e.kind == "swap_in"))
    first_seen = {}
    for index, batch in enumerate(batches):
        for item in batch.items:
            first_seen.setdefault(item.request_id, index)
    assert order == ["b", "c"]
    assert first_seen["late"] > max(i for i, b in enumerate(batches) if b.blocks_to_swap_in)


def test_finished_request_frees_its_blocks_in_the_same_step():
    engine, _ = make_engine(num_blocks=8, enable_prefix_caching=False)
    engine.add_request([1, 2, 3, 4, 5], params(1), request_id="one")
    result = step(engine)
    assert [o.finished for o in result.outputs] == [True]
    assert result.stats.num_free_blocks == 8 and result.stats.num_running == 0
    assert result.snapshot.ref_counts.sum() == 0


def test_max_num_seqs_caps_running_requests():
    engine, _ = make_engine(max_num_seqs=2)
    for _ in range(4):
        engine.add_request([1, 2], params(3))
    result = step(engine)
    assert (result.stats.num_running, result.stats.num_waiting) == (2, 2)
    run_checked(engine)


def test_contiguous_allocator_admits_fewer_requests_than_paged_for_the_same_pool():
    running = {}
    for allocator in ("paged", "contiguous"):
        engine, _ = make_engine(num_blocks=16, max_model_len=32, allocator=allocator)
        for _ in range(8):
            engine.add_request([1, 2, 3, 4], params(4))
        result = step(engine)
        running[allocator] = result.stats.num_running
        view = result.snapshot.requests[0]
        if allocator == "contiguous":
            assert (view.reserved_slots, view.used_slots) == (32, 4)    # max_model_len reserved
            assert result.stats.kv_token_utilisation == 4 * 2 / (16 * 4)
        else:
            assert (view.reserved_slots, view.used_slots) == (4, 4)
            assert result.stats.kv_token_utilisation == 1.0
        run_checked(engine)
    assert running == {"paged": 8, "contiguous": 2}


def test_prefix_hit_skips_cached_blocks_and_reports_hits_in_tokens():
    engine, batches = make_engine(num_blocks=32)
    shared = list(range(10))        # 2 full blocks + 2 tokens
    engine.generate([shared], params(2))
    engine.add_request(shared + [42], params(2), request_id="second")
    result = step(engine)
    item = batches[-1].items[0]
    assert (item.start_pos, len(item.token_ids)) == (8, 3)
    assert result.stats.prefix_cache_queries == 10 + 11
    assert result.stats.prefix_cache_hits == 8
    assert result.snapshot.requests[0].num_cached_tokens == 8


def test_evicting_cached_blocks_emits_an_event_prefix_end_first():
    engine, _ = make_engine(num_blocks=4, max_model_len=16)
    engine.generate([list(range(8))], params(1))        # leaves 2 cached-free blocks, 2 plain
    cached = sorted(engine.scheduler.kv.block_pool.cached_blocks.items())   # (hash, block) per position
    engine.add_request(list(range(100, 113)), params(2), request_id="big")    # needs all 4
    result = step(engine)
    evictions = [e for e in result.events if e.kind == "evict"]
    first_block, second_block = (block for _, block in sorted(cached, key=lambda hb: hb[1]))
    assert [(e.request_id, e.blocks) for e in evictions] == [("big", (second_block, first_block))]
    assert result.stats.num_cached_free_blocks == 0


def test_a_decode_asks_the_kv_cache_for_a_slot_only_where_a_block_starts():
    """Inside a block a decoding sample's table already holds its next slot, so schedule() skips the call that
    would say so: that check ran for every request every step (the fake runner still verifies every KV read)."""
    engine, _ = make_engine()   # blocks of 4
    kv = engine.scheduler.kv
    asked, append_slot = [], kv.append_slot
    kv.append_slot = lambda seq: asked.append(seq.num_computed_tokens) or append_slot(seq)
    engine.add_request(list(range(6)), params(9))
    while engine.has_unfinished_requests():
        step(engine)
    assert asked == [8, 12]     # decodes at positions 6..13
