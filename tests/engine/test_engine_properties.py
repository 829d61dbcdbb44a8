"""Property tests: random workloads on tight pools keep every invariant after every step, leak nothing,
and produce exactly the tokens an uninterrupted run on a huge pool produces."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from invariants import BlockArraysReplica, GeneratedTokens, KVEventReplica, TableGrowth, check_invariants

from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.hybrid_kv_cache_manager import make_kv_cache_manager
from kvscope.engine.kv_cache_groups import KVCacheGroup
from kvscope.engine.kv_cache_manager import KVCacheManager

MAX_MODEL_LEN = 48
MAX_STEPS = 3000


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    params: SamplingParams
    abort_after: int | None     # steps after arrival; None: never aborted


@dataclass
class Scenario:
    config: EngineConfig
    num_blocks: int
    num_host_blocks: int
    eos_period: int | None
    arrivals: list[Arrival]
    groups: tuple[KVCacheGroup, ...] = ()


@st.composite
def arrivals(draw, prefixes: list[list[int]]) -> Arrival:
    prefix = draw(st.sampled_from(prefixes))
    suffix = draw(st.lists(st.integers(0, 255), max_size=6))
    prompt = (prefix + suffix)[:30] or [0]
    params = SamplingParams(n=draw(st.integers(1, 3)), max_tokens=draw(st.integers(1, 12)),
                            temperature=draw(st.sampled_from([0.0, 1.0])), seed=draw(st.integers(0, 3)))
    abort_after = draw(st.one_of(st.none(), st.none(), st.integers(0, 15)))
    return Arrival(draw(st.integers(0, 3)), prompt, params, abort_after)


@st.composite
def hybrid_groups(draw) -> tuple[KVCacheGroup, ...]:
    """A full group beside sliding ones, or sliding groups only (Mistral's shape), windows of 1 to 20 tokens."""
    windows = draw(st.lists(st.integers(1, 20), min_size=1, max_size=2))
    kinds = ([None] if draw(st.booleans()) else []) + windows
    return tuple(KVCacheGroup((layer,), window) for layer, window in enumerate(kinds))


@st.composite
def scenarios(draw, groups=None) -> Scenario:
    config = EngineConfig(
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        max_num_batched_tokens=draw(st.integers(3, 40)),
        max_num_seqs=draw(st.integers(2, 8)),
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        allocator=draw(st.sampled_from(["paged", "contiguous"])),
    )
    kv_cache_groups = draw(groups) if groups is not None else ()
    prefixes = draw(st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=20), min_size=1, max_size=3))
    workload = draw(st.lists(arrivals(prefixes), min_size=2, max_size=8))
    # Tight: just enough for the largest request, plus a little.
    sizing = make_kv_cache_manager(config, 1, 0, config.block_size, MAX_MODEL_LEN, kv_cache_groups)
    largest = max(sizing.max_blocks_needed(len(a.prompt), a.params.max_tokens, a.params.n) for a in workload)
    return Scenario(config, largest + draw(st.integers(0, 3)), draw(st.sampled_from([0, 2, 64])),
                    draw(st.sampled_from([None, 6])), workload, kv_cache_groups)


def run(scenario: Scenario) -> tuple[dict, set, object]:
    """Step the scenario, checking invariants and replaying kv_events after every step. Returns final outputs
    by arrival index, the aborted arrivals and the engine."""
    engine = fake_engine(scenario.config, num_blocks=scenario.num_blocks,
                         num_host_blocks=scenario.num_host_blocks, max_model_len=MAX_MODEL_LEN,
                         eos_period=scenario.eos_period, kv_cache_groups=scenario.groups)
    request_ids: dict[int, str] = {}
    final: dict[str, object] = {}
    aborted: set[str] = set()
    replica, blocks, growth = KVEventReplica(groups=bool(scenario.groups)), BlockArraysReplica(), TableGrowth()
    generated = GeneratedTokens()
    step = 0
    while len(request_ids) < len(scenario.arrivals) or engine.has_unfinished_requests():
        for index, arrival in enumerate(scenario.arrivals):
            if arrival.step == step:
                request_ids[index] = engine.add_request(arrival.prompt, arrival.params)
            if arrival.abort_after is not None and arrival.step + arrival.abort_after == step:
                if engine.abort_request(request_ids[index]):
                    aborted.add(request_ids[index])
        if step % 3 == 1:
            engine.snapshot()   # a look between steps must not take changes from the next step's report
        result = engine.step()
        blocks.step(result, engine.scheduler.kv.block_pool)     # before check_invariants reads the arrays whole
        check_invariants(engine, result)
        replica.step(result)
        growth.step(result)
        generated.step(result)
        final.update((o.request_id, o) for o in result.outputs if o.finished)
        step += 1
        assert step < MAX_STEPS, "the engine stopped making progress"
    check_invariants(engine)
    assert set(final) == set(request_ids.values()), "every request gets a final output"
    for kind, count in replica.counts.items():
        event(f"{kind.__name__} events: {'some' if count else 'none'}")
    event(f"one-sample tables followed across steps: {'yes' if growth.checked else 'no'}")
    event(f"preempted ({scenario.config.preemption_mode}): {'yes' if engine.scheduler.num_preemptions else 'no'}")
    return {index: final[rid] for index, rid in request_ids.items()}, {
        index for index, rid in request_ids.items() if rid in aborted}, engine


def reference(scenario: Scenario) -> list:
    config = EngineConfig(block_size=16, max_num_batched_tokens=4096)
    engine = fake_engine(config, num_blocks=4096, max_model_len=MAX_MODEL_LEN, eos_period=scenario.eos_period,
                         kv_cache_groups=scenario.groups if scenario.config.allocator == "paged" else ())
    return engine.generate([a.prompt for a in scenario.arrivals], [a.params for a in scenario.arrivals])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_keep_invariants_and_match_an_uninterrupted_run(scenario):
    check_against_an_uninterrupted_run(scenario)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(hybrid_groups()))
def test_hybrid_groups_keep_invariants_per_group_and_match_an_uninterrupted_run(scenario):
    """The same workloads with KV-cache groups: sliding groups free blocks as requests advance, and the fake
    runner checks every group's reads (no NULL entry, no freed block, the right tokens)."""
    engine = check_against_an_uninterrupted_run(scenario)
    kv = engine.scheduler.kv
    if scenario.config.allocator == "paged":
        event(f"blocks freed by a window: {'some' if kv.num_window_freed_blocks else 'none'}")


def check_against_an_uninterrupted_run(scenario: Scenario):
    outputs, aborted, engine = run(scenario)
    expected = reference(scenario)
    for index, output in outputs.items():
        if index in aborted:
            assert any(s.finish_reason == "abort" for s in output.samples)
            continue
        assert [s.token_ids for s in output.samples] == [s.token_ids for s in expected[index].samples]
        assert [s.finish_reason for s in output.samples] == [s.finish_reason for s in expected[index].samples]
        assert [s.text for s in output.samples] == [s.text for s in expected[index].samples]
    pool = engine.scheduler.kv.block_pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.ref_counts.any()
    return engine


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_tiny_pools_force_preemption_in_both_modes(data):
    """Several long requests on a pool that holds one or two: preemption must happen, and change nothing."""
    mode = data.draw(st.sampled_from(["recompute", "swap"]))
    block_size = data.draw(st.sampled_from([2, 4]))
    n = data.draw(st.integers(1, 2))
    prompts = [[k, *range(10)] for k in range(data.draw(st.integers(3, 6)))]
    params = SamplingParams(n=n, max_tokens=14, temperature=1.0, seed=1, ignore_eos=True)
    sizing = KVCacheManager(1, 0, block_size, max_model_len=MAX_MODEL_LEN)
    per_request = sizing.max_blocks_needed(len(prompts[0]), params.max_tokens, n)
    config = EngineConfig(block_size=block_size, preemption_mode=mode, max_num_batched_tokens=64)
    scenario = Scenario(config, per_request + data.draw(st.integers(0, per_request)),
                        data.draw(st.sampled_from([0, 4, 64])), None,
                        [Arrival(0, prompt, params, None) for prompt in prompts])
    outputs, _, engine = run(scenario)
    assert engine.scheduler.num_preemptions > 0
    expected = reference(scenario)
    assert [[s.token_ids for s in outputs[i].samples] for i in range(len(prompts))] == [
        [s.token_ids for s in o.samples] for o in expected]
