"""KV-cache groups on the fake runner: sliding groups give blocks back as requests advance (decode and chunked
prefill), hit the prefix cache with only the window's blocks, survive recompute and swap preemption, and give
the tokens a run without groups gives. The fake runner checks every group's reads after every step."""

from __future__ import annotations

import pytest
from invariants import KVEventReplica, check_invariants, record_batches, run_checked

from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.batch import BatchItem, ScheduledBatch
from kvscope.engine.block_pool import NULL_BLOCK
from kvscope.engine.fake_runner import FakeRunner, fake_engine
from kvscope.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from kvscope.engine.kv_cache_groups import KVCacheGroup, blocks_per_sequence, group_layers, max_concurrency
from kvscope.engine.kv_cache_manager import KVCacheManager

BS = 4
WINDOW = 8
FULL_AND_SLIDING = (KVCacheGroup((0, 2), None), KVCacheGroup((1, 3), WINDOW))
SLIDING_ONLY = (KVCacheGroup((0, 1, 2, 3), WINDOW),)
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def engine(groups=FULL_AND_SLIDING, num_blocks=256, **config):
    config = EngineConfig(**{"block_size": BS, **config})
    return fake_engine(config, num_blocks=num_blocks, max_model_len=128, kv_cache_groups=groups)


def prompt(length: int, salt: int = 0) -> list[int]:
    return [(salt * 31 + i * 7) % 256 for i in range(length)]


def tokens(outputs) -> dict[str, tuple]:
    return {o.request_id: tuple(o.token_ids) for o in outputs if o.finished}


def test_grouping_puts_full_layers_first_in_groups_of_equal_size():
    assert group_layers([None, None, None]) == ()
    assert group_layers([24, None, 24, None]) == (KVCacheGroup((1, 3), None), KVCacheGroup((0, 2), 24))
    # Gemma 3's shape: five local layers per global one, so six groups of one layer each.
    assert [g.sliding_window for g in group_layers([512] * 5 + [None])] == [None] + [512] * 5
    assert group_layers([24] * 4) == (KVCacheGroup((0, 1, 2, 3), 24),)


def test_a_sliding_group_holds_at_most_the_window_plus_one_block_per_sequence():
    full = (KVCacheGroup((0,), None),)
    assert blocks_per_sequence(full + (KVCacheGroup((1,), 24),), 1024, 16, 1) == 64 + 3
    assert blocks_per_sequence((KVCacheGroup((0,), 4096),), 1024, 16, 2048) == 64  # never more than the tokens
    assert max_concurrency(SLIDING_ONLY, 300, BS, 128, 1) == 300 / 3


def test_a_model_with_only_full_attention_keeps_the_one_group_manager():
    assert type(engine(groups=()).scheduler.kv) is KVCacheManager
    assert type(engine().scheduler.kv) is HybridKVCacheManager
    assert type(engine(allocator="contiguous").scheduler.kv) is KVCacheManager


@pytest.mark.parametrize("groups", [FULL_AND_SLIDING, SLIDING_ONLY], ids=["full+sliding", "sliding only"])
def test_decode_gives_back_blocks_that_left_the_window(groups):
    e = engine(groups)
    batches = record_batches(e)
    e.add_request(prompt(20), GREEDY)
    run_checked(e)
    sliding = [i for i, g in enumerate(groups) if g.sliding_window]
    decodes = [b.items[0] for b in batches if len(b.items[0].token_ids) == 1]
    for item in decodes:
        for group in sliding:
            live = [block for block in item.group_tables[group] if block != NULL_BLOCK]
            assert len(live) <= -(-WINDOW // BS) + 1
    last = decodes[-1].group_tables
    assert last[sliding[0]][0] == NULL_BLOCK and len(last[sliding[0]]) == -(-(20 + 29) // BS)
    assert e.scheduler.kv.num_window_freed_blocks > 0


def test_full_and_sliding_groups_give_the_tokens_of_a_run_without_groups():
    prompts = [prompt(n, salt) for salt, n in enumerate((5, 19, 33, 47))]
    with_groups, without = engine(max_num_batched_tokens=9), engine(groups=(), max_num_batched_tokens=9)
    for e in (with_groups, without):
        for p in prompts:
            e.add_request(p, GREEDY)
    assert tokens(run_checked(with_groups)) == tokens(run_checked(without))


@pytest.mark.parametrize("groups", [FULL_AND_SLIDING, SLIDING_ONLY], ids=["full+sliding", "sliding only"])
def test_chunked_prefill_frees_window_blocks_before_the_prompt_ends(groups):
    e = engine(groups, max_num_batched_tokens=5)
    e.add_request(prompt(60), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    freed_mid_prompt = []

    def watch(result):
        seq = e.scheduler.requests["0"].seqs[0] if "0" in e.scheduler.requests else None
        if seq is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
            freed_mid_prompt.append(e.scheduler.kv.num_window_freed_blocks)

    run_checked(e, on_step=watch)
    assert freed_mid_prompt[-1] > 0


@pytest.mark.parametrize("groups", [FULL_AND_SLIDING, SLIDING_ONLY], ids=["full+sliding", "sliding only"])
def test_a_sliding_group_hits_the_prefix_cache_with_only_the_window_blocks(groups):
    e = engine(groups)
    batches = record_batches(e)
    shared = prompt(40)
    e.add_request(shared + [1, 2], GREEDY)
    first = tokens(run_checked(e))
    e.add_request(shared + [1, 2], GREEDY)
    second = run_checked(e)
    assert second[-1].num_cached_tokens == 40 and tuple(second[-1].token_ids) == first["0"]
    admitted = next(b.items[0] for b in batches if b.items[0].request_id == "1")
    sliding = next(i for i, g in enumerate(groups) if g.sliding_window)
    table = admitted.group_tables[sliding]
    assert admitted.start_pos == 40 and table[:(40 - WINDOW + 1) // BS] == (NULL_BLOCK,) * ((40 - WINDOW + 1) // BS)


def test_each_group_keys_its_cached_prefixes_apart():
    e = engine()
    replica = KVEventReplica(groups=True)
    e.add_request(prompt(33), SamplingParams(max_tokens=1, temperature=0.0))
    while e.has_unfinished_requests():
        result = e.step()
        check_invariants(e, result)
        replica.step(result)
    assert len(replica.cached) == 2 * (33 // BS)   # one cached block per full block per group


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("groups", [FULL_AND_SLIDING, SLIDING_ONLY], ids=["full+sliding", "sliding only"])
def test_preemption_with_sliding_groups_changes_no_token(mode, groups):
    prompts = [prompt(18, salt) for salt in range(5)]
    params = SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    config = EngineConfig(block_size=BS, preemption_mode=mode, max_num_batched_tokens=16)
    one_request = engine(groups, max_num_batched_tokens=16).scheduler.max_blocks_needed(18, 24, 2)
    tight = fake_engine(config, num_blocks=one_request + 2, num_host_blocks=64, max_model_len=128,
                        kv_cache_groups=groups)
    roomy = engine(groups, max_num_batched_tokens=16)
    for e in (tight, roomy):
        for p in prompts:
            e.add_request(p, params)
    got = {o.request_id: [s.token_ids for s in o.samples] for o in run_checked(tight) if o.finished}
    want = {o.request_id: [s.token_ids for s in o.samples] for o in run_checked(roomy) if o.finished}
    assert tight.scheduler.num_preemptions > 0 and got == want
    if mode == "swap":
        assert tight.scheduler.kv.num_swapped_out_blocks > 0


def test_the_fake_runner_refuses_a_read_of_a_freed_block_or_a_null_entry():
    runner = FakeRunner(EngineConfig(block_size=BS), num_blocks=8, kv_cache_groups=FULL_AND_SLIDING)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    item = BatchItem(0, "r", tuple(range(12)), 0, (0, 1, 2, 3, 4, 5), (0,), params, ((0, 1, 2), (3, 4, 5)))
    runner.block_is_free = lambda block: block == 4
    with pytest.raises(AssertionError, match="freed blocks"):
        runner.execute(ScheduledBatch(items=(item,)))
    runner.block_is_free = None
    window_start = 12 - WINDOW + 1   # the decode at 12 sees 5..12: block 1 (positions 4..7) is still needed
    decode = BatchItem(0, "r", (9,), 12, (0, 1, 2, 6, 5, 7), (0,), params,
                       ((0, 1, 2, 6), (NULL_BLOCK, NULL_BLOCK, 5, 7)))
    assert window_start // BS == 1
    with pytest.raises(AssertionError, match="NULL"):
        runner.execute(ScheduledBatch(items=(decode,)))


def test_a_groups_prefix_key_never_equals_another_prefixs_chain_hash():
    """Group 1's key of the prefix [0] once equalled the chain hash of [0, 1]: the second request then hit group
    0's block of token 1 as group 1's block of token 0, and read the wrong K/V."""
    config = EngineConfig(block_size=1, max_num_seqs=2, max_num_batched_tokens=3)
    groups = (KVCacheGroup((0,), 1), KVCacheGroup((1,), 2))
    e = fake_engine(config, num_blocks=4, max_model_len=48, kv_cache_groups=groups)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    e.add_request([0, 1], params)
    e.add_request([0, 1], params)
    outputs = run_checked(e)
    assert outputs[-1].num_cached_tokens == 1 and outputs[0].token_ids == outputs[-1].token_ids


def test_the_snapshot_keeps_group_tables_when_sample_0_finishes_first():
    """A request whose sample 0 finished while another sample runs once lost its group tables in the snapshot."""
    e = engine(groups=(KVCacheGroup((0,), 1),), num_blocks=6, block_size=1, max_num_seqs=2,
               max_num_batched_tokens=3, enable_prefix_caching=False)
    for max_tokens in (1, 1, 1, 1, 2):
        e.add_request([0], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    e.add_request([0], SamplingParams(n=3, max_tokens=2, temperature=0.0))
    run_checked(e)
