"""add_request refuses bad input with one RequestError before anything changes, keeps its own copy of the
sampling parameters, and samples tiny temperatures greedily; EngineConfig type-checks every field."""

from __future__ import annotations

import dataclasses
import math

import pytest
from bad_inputs import BAD_INPUTS, all_cases
from invariants import check_invariants, run_checked

from kvscope.engine import ConfigError, EngineConfig, LLMEngine, RequestError, SamplingParams
from kvscope.engine.config import GREEDY_TEMPERATURE
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.outputs import EventKind


def make_engine(**config):
    config.setdefault("block_size", 4)
    return fake_engine(EngineConfig(**config), num_blocks=16, max_model_len=128)


def greedy(max_tokens=4, **fields):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


def engine_state(engine) -> tuple:
    scheduler = engine.scheduler
    pool = scheduler.kv.block_pool
    return (list(scheduler.requests), [r.request_id for r in scheduler.waiting],
            [r.request_id for r in scheduler.running], pool.ref_counts.tolist(), list(pool.free_block_queue),
            engine.has_unfinished_requests())


@pytest.mark.parametrize("category, case", all_cases(), ids=lambda value: value if isinstance(value, str) else "")
def test_bad_input_is_refused_before_anything_changes_and_the_engine_goes_on(category, case):
    prompt, params, request_id, message = case
    engine = make_engine()
    engine.add_request([5, 6, 7], greedy(6), request_id="ok")
    engine.step()
    before = engine_state(engine)
    with pytest.raises(RequestError, match=message):
        engine.add_request(prompt, params, request_id=request_id)
    assert engine_state(engine) == before
    outputs = run_checked(engine)
    assert [o.request_id for o in outputs if o.finished] == ["ok"] and len(outputs[-1].token_ids) == 6


def test_every_category_has_cases():
    assert {category: len(cases) for category, cases in BAD_INPUTS.items()} == {
        "token-id prompt": 12, "chat messages": 7, "sampling params": 35, "request id": 4}


@pytest.mark.parametrize("token_id", [-1, 10**12, 2**63])
def test_out_of_vocabulary_ids_are_checked_before_a_real_tokenizer_decodes_them(token_id):
    from models import tiny_model

    model, tokenizer = tiny_model()
    engine = LLMEngine(EngineConfig(dtype="float32", num_blocks=32, max_model_len=128), model=model,
                       tokenizer=tokenizer)
    with pytest.raises(RequestError, match="vocab_size"):
        engine.add_request([1, 2, token_id], greedy())
    for content in (None, 42, ["hi"]):     # the real chat template would raise jinja's errors
        with pytest.raises(RequestError, match="'content'"):
            engine.add_request([{"role": "user", "content": content}], greedy())
    assert not engine.has_unfinished_requests()


def test_a_chat_template_that_refuses_the_messages_is_a_request_error():
    engine = make_engine()

    def refusing_template(messages, **kwargs):
        raise ValueError("Conversation roles must alternate user/assistant")

    engine.tokenizer.apply_chat_template = refusing_template
    with pytest.raises(RequestError, match="roles must alternate"):
        engine.add_request([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], greedy())
    assert not engine.has_unfinished_requests()


def test_none_stop_rules_mean_none_and_ids_may_be_numpy_integers():
    import numpy as np

    engine = make_engine()
    engine.add_request(np.array([5, 6, 7]).tolist(), greedy(3, stop=None, stop_token_ids=None, seed=3), request_id="a")
    engine.add_request(list(np.array([5, 6, 7])), greedy(3, stop="zz", seed=np.int64(3)), request_id="b")
    final = {o.request_id: o for o in run_checked(engine) if o.finished}
    assert final["a"].token_ids == final["b"].token_ids and len(final["a"].token_ids) == 3


@pytest.mark.parametrize("change", ["n", "max_tokens", "stop_token_ids", "temperature"])
def test_changing_params_after_add_request_changes_nothing(change):
    reference = make_engine().generate([[5, 6, 7]], greedy(6, n=2))[0]
    engine = make_engine()
    params = greedy(6, n=2, stop_token_ids=[])
    engine.add_request([5, 6, 7], params, request_id="r")
    if change == "stop_token_ids":
        params.stop_token_ids.append(reference.token_ids[1])   # a list the caller still holds
    else:
        setattr(params, change, {"n": 3, "max_tokens": 1, "temperature": 1.0}[change])
    outputs = run_checked(engine)
    assert [s.token_ids for s in outputs[-1].samples] == [s.token_ids for s in reference.samples]


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-8, GREEDY_TEMPERATURE / 2, 5e-324])
def test_temperatures_below_the_epsilon_sample_greedily(temperature):
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=1, ignore_eos=True)
    assert params.greedy
    engine = make_engine()
    tiny, exact = engine.generate([[5, 6, 7], [5, 6, 7]], [params, greedy(8, seed=1)])
    assert tiny.token_ids == exact.token_ids
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_tiny_temperatures_give_the_greedy_tokens_with_a_real_model():
    from models import tiny_model

    model, tokenizer = tiny_model()
    engine = LLMEngine(EngineConfig(dtype="float32", num_blocks=32, max_model_len=128), model=model,
                       tokenizer=tokenizer)
    tiny, exact = engine.generate([[10, 11, 12]] * 2, [
        SamplingParams(max_tokens=8, temperature=1e-38, ignore_eos=True), greedy(8)])
    assert tiny.token_ids == exact.token_ids


@pytest.mark.parametrize("field, value, message", [
    ("num_blocks", "10", "num_blocks must be an integer or None"),
    ("num_blocks", 10.0, "num_blocks must be an integer"),
    ("block_size", True, "block_size must be an integer"),
    ("block_size", "16", "block_size must be an integer"),
    ("max_num_seqs", None, "max_num_seqs must be an integer"),
    ("max_num_batched_tokens", False, "max_num_batched_tokens must be an integer"),
    ("max_model_len", "512", "max_model_len must be an integer or None"),
    ("gpu_memory_utilization", "0.5", "gpu_memory_utilization must be a number"),
    ("gpu_memory_utilization", True, "gpu_memory_utilization must be a number"),
    ("enable_prefix_caching", 1, "enable_prefix_caching must be True or False"),
    ("enable_prefix_caching", "no", "enable_prefix_caching must be True or False"),
    ("preemption_mode", "Swap", "preemption_mode must be one of 'recompute', 'swap'"),
    ("allocator", None, "allocator must be one of 'paged', 'contiguous'"),
    ("dtype", "fp16", "dtype must be one of"),
    ("device", 0, "device must be a string"),
    ("device", "cuda:x", "device must be auto, cpu, cuda or cuda:N"),
    ("model", None, "model must be a string"),
    ("seed", 1.5, "seed must be an integer"),
    ("kv_cache_memory", 1.5e9, "kv_cache_memory must be an integer or a string or None"),
    ("kv_cache_memory", "lots", "cannot read 'lots' as a size"),
    ("swap_space", None, "swap_space must be an integer or a string"),
    ("swap_space", -1, "swap_space must be 0 or more"),
])
def test_engine_config_checks_every_field_type(field, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{field: value})


def test_engine_config_normalises_what_it_accepts():
    import numpy as np

    config = EngineConfig(num_blocks=np.int64(64), gpu_memory_utilization=1, device="cuda:1", swap_space=0)
    assert type(config.num_blocks) is int and config.num_blocks == 64
    assert type(config.gpu_memory_utilization) is float and config.device == "cuda:1"
    assert config.swap_space == 0 and EngineConfig(swap_space="0").swap_space == 0
    assert EngineConfig(swap_space="0GiB").swap_space == 0 and EngineConfig().swap_space == 2**30
    assert dataclasses.replace(config, seed=3).num_blocks == 64


def test_swap_space_zero_means_no_host_pool_and_swap_falls_back_to_recompute():
    engine = fake_engine(EngineConfig(block_size=4, preemption_mode="swap", swap_space=0,
                                      max_num_batched_tokens=64), num_blocks=6, num_host_blocks=0)
    for name in "abc":
        engine.add_request(list(range(8)), greedy(12), request_id=name)
    events = []
    outputs = run_checked(engine, on_step=lambda result: events.extend(result.events))
    assert any(e.kind == EventKind.PREEMPT and e.detail == "recompute (host pool full)" for e in events)
    assert sorted(o.request_id for o in outputs if o.finished) == ["a", "b", "c"]
    check_invariants(engine)
    assert math.isclose(0, engine.scheduler.kv.host_pool.num_blocks)
