"""The model runner with KV-cache groups: a model whose layers alternate sliding and full attention gets two
groups sharing one pool whose blocks hold one group's layers, a block table and slot mapping per group, and
the tokens transformers' own generate gives, batched, chunked, prefix-cached and preempted."""

from __future__ import annotations

import pytest
import torch
from invariants import run_checked
from models import reference_generate, tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from kvscope.engine.kv_cache_groups import KVCacheGroup
from kvscope.engine.model import model_runner

# Longer than any context here: until the kernels apply windows, the grouped cache is what is tested.
WINDOW = 200
MAX_MODEL_LEN = 256


def alternating_model(seed: int = 0):
    tok = tokenizer()
    config = AutoConfig.for_model(
        "qwen2", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
        attn_implementation="sdpa")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), tok


@pytest.fixture
def windows_allowed(monkeypatch):
    """The runner refuses windows shorter than max_model_len while its kernels cannot apply them; no context
    here reaches the window, so full attention is exact."""
    monkeypatch.setattr(model_runner, "_check_attention_features", lambda *args: None)


def prompts() -> list[list[int]]:
    shared = [(i * 37) % 5000 + 100 for i in range(40)]
    return [shared + [7, 8, 9], shared + [11], [(i * 13) % 3000 + 200 for i in range(70)], [300, 301, 302]]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_alternating_layers_run_as_two_groups_and_match_transformers(windows_allowed, mode):
    model, tok = alternating_model()
    expected = [reference_generate(model, tok, p, 12) for p in prompts()]
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks=14, max_model_len=MAX_MODEL_LEN,
                          max_num_batched_tokens=32, preemption_mode=mode, swap_space="4MiB")
    engine = LLMEngine(config, model=model, tokenizer=tok)
    runner = engine.runner
    assert runner.kv_cache_groups == (KVCacheGroup((1, 3), None), KVCacheGroup((0, 2), WINDOW))
    assert runner.kv_cache.shape[0] == 2, "a block holds one group's two layers"
    assert type(engine.scheduler.kv) is HybridKVCacheManager
    assert "2 KV-cache groups" in runner.info.banner
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for p in prompts():
        engine.add_request(p, params)
    outputs = {o.request_id: list(o.token_ids) for o in run_checked(engine) if o.finished}
    assert [outputs[str(i)] for i in range(len(expected))] == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.prefix_cache_hits > 0


def test_the_contiguous_allocator_keeps_one_group(windows_allowed):
    model, tok = alternating_model()
    p = prompts()[2]
    expected = reference_generate(model, tok, p, 6)
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks=64, max_model_len=MAX_MODEL_LEN,
                          allocator="contiguous")
    engine = LLMEngine(config, model=model, tokenizer=tok)
    assert engine.runner.kv_cache_groups == () and engine.runner.kv_cache.shape[0] == 4
    out = engine.generate([p], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert list(out.token_ids) == expected
