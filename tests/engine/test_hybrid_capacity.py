"""What a hybrid pool holds, said at start: the too-small-pool warning and vLLM's "Maximum concurrency" count what
each KV-cache group really holds of a request (a sliding group a window and a chunk), not every layer's every
token."""

from __future__ import annotations

from invariants import run_checked

from kvscope.app.messages import EngineInfo
from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.kv_cache_groups import KVCacheGroup, blocks_per_sequence, max_concurrency
from kvscope.engine.runner import capacity_sentence, pool_capacity, pool_warning

BS, WINDOW, CHUNK, MAX_LEN = 4, 8, 4, 128
FULL_AND_SLIDING = (KVCacheGroup((0,), None), KVCacheGroup((1,), WINDOW))
SLIDING_ONLY = (KVCacheGroup((0, 1), WINDOW),)


def engine(groups, num_blocks: int, max_model_len: int = MAX_LEN):
    config = EngineConfig(block_size=BS, max_num_batched_tokens=CHUNK, max_model_len=max_model_len)
    return fake_engine(config, num_blocks=num_blocks, max_model_len=max_model_len, kv_cache_groups=groups)


def test_a_hybrid_pool_short_of_one_request_is_warned_about_though_its_blocks_hold_more_tokens():
    need = blocks_per_sequence(FULL_AND_SLIDING, MAX_LEN, BS, CHUNK)
    assert need == MAX_LEN // BS + 4    # the full group every block; the sliding one a window and a chunk
    short = engine(FULL_AND_SLIDING, need - 1)
    assert (need - 1) * BS >= MAX_LEN, "counted as one group, this pool would look big enough"
    warning = pool_warning(short.info)
    assert warning is not None and "in its 2 KV-cache groups" in warning
    fits = int(warning.split("--max-model-len ")[1].split()[0].replace(",", ""))
    assert fits < MAX_LEN and blocks_per_sequence(FULL_AND_SLIDING, fits, BS, CHUNK) <= need - 1
    assert blocks_per_sequence(FULL_AND_SLIDING, fits + 1, BS, CHUNK) > need - 1
    # Following the advice silences it, and a request that long runs to the end in that pool.
    advised = engine(FULL_AND_SLIDING, need - 1, max_model_len=fits)
    assert pool_warning(advised.info) is None
    advised.add_request(list(range(1, fits - 9)), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    (output,) = [o for o in run_checked(advised) if o.finished]
    assert output.finish_reason == "length" and len(output.token_ids) == 10
    assert pool_warning(engine(FULL_AND_SLIDING, need).info) is None


def test_a_sliding_only_pool_holds_max_model_len_in_a_few_blocks():
    # Every layer slides: a request holds a window's blocks, so 4 blocks hold one of 128 tokens.
    assert pool_warning(engine(SLIDING_ONLY, 4).info) is None
    assert "--max-model-len" in pool_warning(engine(SLIDING_ONLY, 3).info)


def test_maximum_concurrency_counts_what_each_group_holds_everywhere_it_is_shown():
    e = engine(FULL_AND_SLIDING, 360)
    tokens, concurrency = pool_capacity(e.info)
    assert concurrency == max_concurrency(FULL_AND_SLIDING, 360, BS, MAX_LEN, CHUNK) == 360 / (MAX_LEN // BS + 4)
    assert tokens == 360 // 2 * BS      # a token needs a slot in each group's block
    assert concurrency > tokens / MAX_LEN, "a sliding group lets more requests in than its tokens say"
    sentence = capacity_sentence(e.info)
    assert f"{tokens:,} tokens" in sentence and f"{concurrency:.2f}x" in sentence
    assert f"{concurrency:.2f}x" in e.info.banner
    header = EngineInfo(e.info, e.config)
    assert header.num_tokens == tokens and header.max_concurrency == concurrency
    one_group = engine((), 360)
    assert pool_capacity(one_group.info) == (360 * BS, 360 * BS / MAX_LEN)
