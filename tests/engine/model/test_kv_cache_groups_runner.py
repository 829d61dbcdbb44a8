"""The model runner with KV-cache groups, against transformers fp32 with windows shorter than the prompts: a
model whose layers alternate sliding and full attention gets two groups sharing one pool whose blocks hold one
group's layers; Mistral, sliding on every layer, one sliding group. The sliding groups give back blocks as
requests advance, and the tokens are transformers' own generate's, batched, chunked, prefix-cached and
preempted by recompute and by swap."""

from __future__ import annotations

import pytest
import torch
from invariants import run_checked
from models import reference_generate, tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from kvscope.engine.kv_cache_groups import KVCacheGroup

WINDOW = 24
MAX_MODEL_LEN = 256


def windowed_model(arch: str, seed: int = 0):
    """A tiny random model: qwen2 with sliding and full layers alternating, or mistral sliding on every layer."""
    tok = tokenizer()
    layers = {"qwen2": dict(use_sliding_window=True, max_window_layers=4, num_key_value_heads=2,
                            layer_types=["sliding_attention", "full_attention"] * 2),
              "mistral": dict(num_key_value_heads=1)}[arch]
    config = AutoConfig.for_model(
        arch, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16,
        num_attention_heads=4, max_position_embeddings=1024, initializer_range=0.2, sliding_window=WINDOW,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True, attn_implementation="sdpa", **layers)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), tok


GROUPS = {"qwen2": (KVCacheGroup((1, 3), None), KVCacheGroup((0, 2), WINDOW)),
          "mistral": (KVCacheGroup((0, 1, 2, 3), WINDOW),)}


def prompts() -> list[list[int]]:
    shared = [(i * 37) % 5000 + 100 for i in range(40)]
    return [shared + [7, 8, 9], shared + [11], [(i * 13) % 3000 + 200 for i in range(70)], [300, 301, 302]]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_grouped_layers_free_window_blocks_and_match_transformers(arch, mode):
    model, tok = windowed_model(arch)
    expected = [reference_generate(model, tok, p, 12) for p in prompts()]
    # Tight pools: a sliding-only model holds at most a window and a chunk of each request.
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks={"qwen2": 14, "mistral": 7}[arch],
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
    model, tok = windowed_model("qwen2")
    p = prompts()[2]
    expected = reference_generate(model, tok, p, 6)
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks=64, max_model_len=MAX_MODEL_LEN,
                          allocator="contiguous")
    engine = LLMEngine(config, model=model, tokenizer=tok)
    assert engine.runner.kv_cache_groups == () and engine.runner.kv_cache.shape[0] == 4
    out = engine.generate([p], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert list(out.token_ids) == expected
