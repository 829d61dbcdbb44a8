"""StepResult.kv_events: the prefix cache's changes as vLLM's KV-cache events describe them (BlockStored,
BlockRemoved, AllBlocksCleared), which `kvscope serve` publishes. A subscriber that replays them holds exactly
the cached blocks of each step's snapshot; the random workloads of test_engine_properties and
test_engine_faults check that after every step, these tests check what each event says."""

from __future__ import annotations

import pytest
from invariants import KVEventReplica, check_invariants, run_checked

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.fake_runner import InjectedFault, fake_engine
from kvscope.engine.kv_cache_manager import hash_block
from kvscope.engine.outputs import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def make_engine(num_blocks=32, **config):
    config.setdefault("block_size", BS)
    return fake_engine(EngineConfig(**config), num_blocks=num_blocks, max_model_len=64, num_host_blocks=8)


def greedy(max_tokens=2, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def run(engine, replica: KVEventReplica) -> list:
    """Step to idle, replaying every step's kv_events into ``replica`` (which has seen every earlier step's);
    returns them all, flattened."""
    events = []

    def on_step(result):
        replica.step(result)
        events.extend(result.kv_events)

    run_checked(engine, on_step=on_step)
    return events


def test_a_prompt_s_full_blocks_are_stored_as_one_hash_chain_of_its_tokens():
    engine = make_engine()
    prompt = list(range(10, 21))    # 11 tokens: two full blocks; the third fills with the output
    engine.add_request(prompt, greedy(3))
    replica = KVEventReplica()
    result = engine.step()
    replica.step(result)
    assert isinstance(result.kv_events, tuple)
    first, second = result.kv_events
    assert first == BlockStored(hash_block(0, prompt[:4]), None, tuple(prompt[:4]), BS,
                                result.snapshot.requests[0].block_tables[0][0])
    assert second.parent_block_hash == first.block_hash and second.token_ids == tuple(prompt[4:8])
    assert second.block_id == result.snapshot.requests[0].block_tables[0][1]
    with pytest.raises(AttributeError):
        first.block_id = 0
    later = run(engine, replica)
    (third,) = later    # the prompt's last 3 tokens and the first output token fill block 3
    assert third.parent_block_hash == second.block_hash and third.token_ids[:3] == tuple(prompt[8:])


def test_a_shared_prefix_is_stored_once_and_a_hit_stores_nothing_again():
    engine = make_engine()
    replica = KVEventReplica()
    shared = list(range(40, 48))
    engine.add_request(shared + [1], greedy(1))
    first = run(engine, replica)
    assert [e.token_ids for e in first] == [tuple(shared[:4]), tuple(shared[4:])]
    engine.add_request(shared + [2, 3, 4, 5], greedy(1))
    second = run(engine, replica)
    assert [e.token_ids for e in second] == [(2, 3, 4, 5)]
    assert second[0].parent_block_hash == first[-1].block_hash


def test_an_eviction_is_a_block_removed_reported_with_the_evict_event_of_the_same_step():
    engine = make_engine(num_blocks=4)
    replica = KVEventReplica()
    engine.add_request(list(range(100, 108)), greedy(1))   # two full blocks, cached after it finishes
    run(engine, replica)
    engine.add_request(list(range(200, 214)), greedy(1))   # needs all four blocks: both cached ones go
    result = engine.step()
    replica.step(result)
    removed = [e for e in result.kv_events if type(e) is BlockRemoved]
    evicted = [block for e in result.events if e.kind == "evict" for block in e.blocks]
    assert len(removed) == 2 and [e.block_id for e in removed] == evicted
    assert {e.block_hash for e in removed} == {hash_block(0, range(100, 104)),
                                               hash_block(hash_block(0, range(100, 104)), range(104, 108))}
    run(engine, replica)


@pytest.mark.parametrize("config", [dict(enable_prefix_caching=False), dict(allocator="contiguous")])
def test_without_a_prefix_cache_there_are_no_kv_events(config):
    engine = make_engine(num_blocks=64, **config)
    for k in range(3):
        engine.add_request(list(range(k, k + 13)), greedy(6, n=2))
    assert run(engine, KVEventReplica()) == []


def test_reset_prefix_cache_is_refused_while_blocks_are_held_and_reported_as_all_blocks_cleared():
    engine = make_engine()
    replica = KVEventReplica()
    engine.add_request(list(range(9)), greedy(4))
    replica.step(engine.step())
    assert not engine.reset_prefix_cache()      # the request holds its blocks
    run(engine, replica)
    assert replica.cached
    assert engine.reset_prefix_cache()
    assert not engine.snapshot().block_hashes.any()
    engine.add_request(list(range(9)), greedy(1))     # the same prompt: no hit any more
    result = engine.step()
    replica.step(result)
    assert result.kv_events[0] == AllBlocksCleared()
    assert [type(e) for e in result.kv_events[1:]] == [BlockStored, BlockStored]    # its two full blocks again
    (output,) = result.outputs
    assert output.finished and output.num_cached_tokens == 0


def test_a_failed_step_s_prefix_changes_come_with_the_next_step(monkeypatch):
    engine = make_engine()
    replica = KVEventReplica()
    engine.add_request(list(range(30, 39)), greedy(3), request_id="a")
    kv = engine.scheduler.kv
    commit = kv.commit

    def commit_then_fail(*args):    # the update caches the prompt's blocks, then the step fails
        commit(*args)
        raise InjectedFault("after commit")

    monkeypatch.setattr(kv, "commit", commit_then_fail)
    with pytest.raises(InjectedFault):
        engine.step()
    monkeypatch.undo()
    check_invariants(engine)
    engine.add_request([5, 6, 7], greedy(1), request_id="b")
    result = engine.step()
    replica.step(result)
    stored = [e.block_id for e in result.kv_events if type(e) is BlockStored]
    removed = [e.block_id for e in result.kv_events if type(e) is BlockRemoved]
    assert len(stored) == 2 and sorted(removed) == sorted(stored)     # a's blocks may be half written
    assert not [e for e in result.events if e.kind == "evict"]        # dropped, not evicted for room
    assert {o.request_id: o.finish_reason for o in result.outputs if o.finished}["a"] == "error"
    run(engine, replica)


def test_swap_preemption_keeps_the_replica_exact():
    engine = make_engine(num_blocks=8, preemption_mode="swap", max_num_batched_tokens=64)
    prompts = [[k, *range(50, 59)] for k in range(4)]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True))
    replica = KVEventReplica()
    run(engine, replica)
    assert engine.scheduler.num_preemptions and replica.counts[BlockRemoved]


def test_the_default_model_s_chat_prompts_are_stored_token_for_token():
    """The user's path: the default model, chat messages through its template, a shared system prompt."""
    engine = LLMEngine(EngineConfig(num_blocks=64, max_model_len=512))
    bs = engine.block_size
    system = {"role": "system", "content": "You are a terse assistant. Answer in one word, in English only."}
    replica = KVEventReplica()
    stored: list[list[BlockStored]] = []
    for question in ["What colour is the sky on a clear day?", "What is the opposite of cold?"]:
        messages = [system, {"role": "user", "content": question}]
        engine.add_request(messages, SamplingParams(max_tokens=2, temperature=0.0))
        stored.append([])
        finished = []
        while engine.has_unfinished_requests():
            result = engine.step()
            replica.step(result)
            stored[-1].extend(e for e in result.kv_events if type(e) is BlockStored)
            finished.extend(o for o in result.outputs if o.finished)
        (output,) = finished
        written = output.prompt_token_ids + output.token_ids[:-1]     # the last token drawn is never written
        full_blocks = [written[i:i + bs] for i in range(0, len(written) - bs + 1, bs)]
        cached = output.num_cached_tokens // bs
        # Each conversation stored its full blocks, in order, but those it found in the cache.
        assert [e.token_ids for e in stored[-1]] == full_blocks[cached:]
    assert cached >= 1, "the second conversation reuses the system prompt's blocks"
    assert stored[1][0].parent_block_hash == stored[0][cached - 1].block_hash
