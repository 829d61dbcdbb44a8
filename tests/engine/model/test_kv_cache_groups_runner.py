"""The model runner with KV-cache groups, against transformers fp32 with windows shorter than the prompts: a
model with a full and a sliding layer gets two groups sharing one pool whose blocks hold one group's layers;
Mistral, sliding on every layer, one sliding group. The sliding groups give back blocks as
requests advance, and the tokens are transformers' own generate's, batched, chunked, prefix-cached and
preempted by recompute and by swap."""

from __future__ import annotations

import pytest
from invariants import run_checked
from models import WINDOW, reference_generate, tiny_model

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from kvscope.engine.kv_cache_groups import KVCacheGroup

MAX_MODEL_LEN = 256


# tests/support/models.py's tiny window models: qwen2 [full, sliding], mistral sliding on both layers.
GROUPS = {"qwen2-window": (KVCacheGroup((0,), None), KVCacheGroup((1,), WINDOW)),
          "mistral-window": (KVCacheGroup((0, 1), WINDOW),)}
# Pools tight enough to preempt: a sliding-only model holds no more than a window and a chunk of each request.
POOL_BLOCKS = {"qwen2-window": 14, "mistral-window": 7}


def prompts() -> list[list[int]]:
    shared = [(i * 37) % 5000 + 100 for i in range(40)]
    return [shared + [7, 8, 9], shared + [11], [(i * 13) % 3000 + 200 for i in range(70)], [300, 301, 302]]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("arch", list(GROUPS))
def test_grouped_layers_free_window_blocks_and_match_transformers(arch, mode):
    model, tok = tiny_model(arch)
    expected = [reference_generate(model, tok, p, 12) for p in prompts()]
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks=POOL_BLOCKS[arch],
                          max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32, preemption_mode=mode,
                          swap_space="4MiB")
    engine = LLMEngine(config, model=model, tokenizer=tok)
    runner = engine.runner
    assert runner.kv_cache_groups == GROUPS[arch]
    assert runner.kv_cache.shape[0] == len(GROUPS[arch][-1].layers), "a block holds one group's layers"
    assert type(engine.scheduler.kv) is HybridKVCacheManager
    assert f"{len(GROUPS[arch])} KV-cache groups" in runner.info.banner
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for p in prompts():
        engine.add_request(p, params)
    outputs = {o.request_id: list(o.token_ids) for o in run_checked(engine) if o.finished}
    assert [outputs[str(i)] for i in range(len(expected))] == expected
    kv = engine.scheduler.kv
    assert engine.scheduler.num_preemptions > 0 and kv.prefix_cache_hits > 0 and kv.num_window_freed_blocks > 0


def test_the_contiguous_allocator_keeps_one_group():
    model, tok = tiny_model("qwen2-window")
    p = prompts()[2]
    expected = reference_generate(model, tok, p, 6)
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks=64, max_model_len=MAX_MODEL_LEN,
                          allocator="contiguous")
    engine = LLMEngine(config, model=model, tokenizer=tok)
    assert engine.runner.kv_cache_groups == () and engine.runner.kv_cache.shape[0] == 2
    out = engine.generate([p], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert list(out.token_ids) == expected
