"""Real generation through the paged cache is token-identical to transformers' own greedy generate.

Each architecture gets one set of ragged prompts whose references are computed
once; every scenario then replays them through a differently configured engine
(chunked, prefix-cached, preempted, swapped, forked, contiguous) and must agree
to the token, with the block-pool invariants checked after every step. On CPU
every scenario runs on what serves by default: the C++ attention kernels (where
a compiler exists) and prepacked linear layers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from invariants import check_invariants
from models import TINY_ARCHS, TINY_WINDOW_ARCHS, load_smollm2, reference_generate, tiny_model

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.model import fused_ops, packed_linear
from kvscope.engine.model.packed_linear import is_packed
from kvscope.kernels import cpu, reference

# The window families' prompts run past their 24-token windows (prompt lengths 3-70, plus up to 14 tokens).
ARCHS = ["smollm2", *TINY_ARCHS, *TINY_WINDOW_ARCHS]
NUM_PROMPTS = 16


@dataclass
class Case:
    arch: str
    prompts: list[list[int]]
    max_tokens: list[int]
    expected: list[list[int]]

    def fresh_model(self):
        return load_smollm2() if self.arch == "smollm2" else tiny_model(self.arch)


def make_prompts(tok, rng: random.Random) -> list[list[int]]:
    prompts = [[rng.randrange(100, len(tok) - 100) for _ in range(rng.randint(3, 70))] for _ in range(NUM_PROMPTS)]
    # Prompt 1 shares prompt 0's first 40 tokens: two full blocks and a half at block size 16.
    prompts[0] = [rng.randrange(100, 40000) for _ in range(60)]
    prompts[1] = prompts[0][:40] + [rng.randrange(100, 40000) for _ in range(9)]
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def case(request) -> Case:
    rng = random.Random(1234)
    probe = Case(request.param, [], [], [])
    model, tok = probe.fresh_model()
    prompts = make_prompts(tok, rng)
    max_tokens = [rng.randint(2, 14) for _ in prompts]
    expected = [reference_generate(model, tok, p, n) for p, n in zip(prompts, max_tokens)]
    return Case(request.param, prompts, max_tokens, expected)


def build_engine(case: Case, **overrides) -> LLMEngine:
    model, tok = case.fresh_model()
    settings = dict(dtype="float32", block_size=16, num_blocks=256, max_model_len=512)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), model=model, tokenizer=tok)


def greedy(n_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True, n=n)


def run_all(engine: LLMEngine, case: Case, indices, n: int = 1) -> dict:
    finals = {}
    ids = {engine.add_request(case.prompts[i], greedy(case.max_tokens[i], n)): i for i in indices}
    while engine.has_unfinished_requests():
        result = engine.step()
        check_invariants(engine)
        for output in result.outputs:
            if output.finished:
                finals[ids[output.request_id]] = output
    check_invariants(engine)
    assert engine.step().stats.num_free_blocks == engine.num_blocks
    return finals


def assert_matches(case: Case, finals: dict) -> None:
    for i, output in finals.items():
        assert list(output.token_ids) == case.expected[i], f"prompt {i} diverged"


def test_one_request(case):
    assert_matches(case, run_all(build_engine(case), case, [2]))


def test_concurrent_ragged_requests(case):
    engine = build_engine(case, enable_prefix_caching=False)
    finals = run_all(engine, case, range(NUM_PROMPTS))
    assert len(finals) == NUM_PROMPTS
    assert_matches(case, finals)


def test_prefix_cache_hit(case):
    engine = build_engine(case)
    first = run_all(engine, case, [0])
    second = run_all(engine, case, [1])
    assert second[1].num_cached_tokens == 32  # two full shared blocks; the partial third is never cached
    assert_matches(case, {**first, **second})


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(case, mode):
    engine = build_engine(case, num_blocks=12, preemption_mode=mode, swap_space="64MiB")
    finals = run_all(engine, case, range(NUM_PROMPTS))
    assert sum(output.num_preemptions for output in finals.values()) > 0
    assert_matches(case, finals)


def test_chunked_prefill_on_the_default_cpu_path(case, monkeypatch):
    """Prefills chunked beside decodes, on what every test here runs on by default: where a compiler exists, the
    C++ attention (the torch reference fails if reached), kvscope's own packed linears (the C++ ones; no oneDNN
    packs) and the C++ RMSNorm."""
    def unreachable(*args, **kwargs):
        raise AssertionError("the torch reference attention served a step")

    if cpu.available():
        monkeypatch.setattr(reference, "paged_decode_attention", unreachable)
        monkeypatch.setattr(reference, "paged_prefill_attention", unreachable)
    engine = build_engine(case, max_num_batched_tokens=24)
    if cpu.available():
        check_cpp_linears_and_norms(engine, case.arch)
    assert_matches(case, run_all(engine, case, range(NUM_PROMPTS)))


def check_cpp_linears_and_norms(engine: LLMEngine, arch: str) -> None:
    for layer in engine.runner.model.model.layers:
        # gpt-oss's experts are batched parameters, not linears.
        mlp = [layer.mlp.down_proj] if hasattr(layer.mlp, "down_proj") else []
        for linear in (layer.self_attn.q_proj, layer.self_attn.v_proj, *mlp):
            assert is_packed(linear) and cpu.is_packed_linear_weight(getattr(linear, packed_linear._PACKED))
        if not arch.startswith("gemma"):   # Gemma's 1 + weight norm is left to transformers
            assert fused_ops.is_fused(layer.input_layernorm) and fused_ops.is_fused(layer.post_attention_layernorm)


def test_the_torch_attention_path_computes_the_same_variants(case, monkeypatch):
    """Where the C++ kernels cannot serve (no compiler, float16) the torch reference does: windows, soft-caps and
    sinks included."""
    if case.arch not in TINY_WINDOW_ARCHS:
        pytest.skip("the plain families' torch path is tested in test_truth.py")
    monkeypatch.setenv("KVSCOPE_CPU_KERNELS", "torch")
    cpu.status.cache_clear()
    try:
        engine = build_engine(case, max_num_batched_tokens=40)
        assert_matches(case, run_all(engine, case, range(NUM_PROMPTS)))
        assert not cpu.available()
    finally:
        cpu.status.cache_clear()   # the next test finds the machine's own choice again


def test_two_greedy_samples_share_the_prompt(case):
    finals = run_all(build_engine(case), case, [3, 4], n=2)
    for i, output in finals.items():
        assert [list(s.token_ids) for s in output.samples] == [case.expected[i]] * 2


def test_contiguous_allocator(case):
    engine = build_engine(case, allocator="contiguous", max_model_len=96, num_blocks=48)
    assert_matches(case, run_all(engine, case, range(NUM_PROMPTS)))


def test_generate_returns_one_output_per_prompt_with_exact_lengths():
    model, tok = tiny_model("llama")
    engine = LLMEngine(EngineConfig(dtype="float32", num_blocks=128, max_model_len=256), model=model,
                       tokenizer=tok)
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 30))] for _ in range(32)]
    lengths = [rng.randint(1, 12) for _ in prompts]
    outputs = engine.generate(prompts, [greedy(n) for n in lengths])
    assert [len(o.token_ids) for o in outputs] == lengths
    assert all(o.finish_reason == "length" for o in outputs)


def test_chat_answers_coherently_with_smollm2():
    model, tok = load_smollm2()
    engine = LLMEngine(EngineConfig(dtype="float32", num_blocks=64), model=model, tokenizer=tok)
    [output] = engine.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                               SamplingParams(max_tokens=24, temperature=0.0))
    assert output.text.strip()
    assert output.finish_reason in ("stop", "length")
    assert "Paris" in output.text


def test_nan_logits_fail_one_request_and_others_continue():
    model, tok = tiny_model("llama")
    engine = LLMEngine(EngineConfig(dtype="float32", num_blocks=64, max_model_len=256), model=model,
                       tokenizer=tok)
    poisoned = 40001
    with torch.no_grad():
        # Untie first: a NaN row in a tied output layer would poison every request's logits.
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.get_input_embeddings().weight[poisoned] = float("nan")
    good = engine.add_request([5, 6, 7, 8], greedy(6))
    bad = engine.add_request([9, poisoned, 11], greedy(6))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.finished:
                finals[output.request_id] = output
        check_invariants(engine)
    assert finals[bad].finish_reason == "error" and finals[bad].error
    assert finals[good].finish_reason == "length" and len(finals[good].token_ids) == 6


def test_a_loaded_model_is_kept_out_of_the_garbage_collectors_walks():
    import gc

    gc.unfreeze()
    model, tok = tiny_model("llama")
    assert any(o is model for o in gc.get_objects())
    LLMEngine(EngineConfig(device="cpu", num_blocks=16), model=model, tokenizer=tok)
    # Frozen objects are no longer among those a collection walks.
    assert not any(o is model for o in gc.get_objects())
