"""A step either happens or it doesn't: a fault at any phase leaves the cache consistent.

Faults are injected with the FakeRunner, whose every KV read is checked against the tokens the engine
thinks are there, so a lost swap, copy or write shows up as a wrong read in a later step. A fault
during schedule() or the update is a chosen call of the KV cache manager or the block pool that
raises, before or after doing its work; a fault in the runner is its fault_at phase.
"""

from __future__ import annotations

from collections import Counter

import pytest
from bad_inputs import all_cases
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from invariants import KVEventReplica, check_invariants, record_batches, run_checked

from kvscope.engine import EngineConfig, RequestError, SamplingParams
from kvscope.engine.fake_runner import InjectedFault, fake_engine

SCHEDULE_CALLS = [("kv", "append_slot"), ("kv", "allocate_slots"), ("kv", "allocate_for_admission"),
                  ("kv", "swap_in"), ("kv", "swap_out"), ("kv", "free_request"), ("kv", "take_cache_moves"),
                  ("pool", "allocate"), ("pool", "touch")]
UPDATE_CALLS = [("kv", "commit"), ("kv", "fork"), ("kv", "free_sequence"), ("pool", "register"),
                ("pool", "free")]
RUNNER_PHASES = ["moves", "forward", "sample"]


class Fault:
    """Make the ``nth`` call of one method raise InjectedFault, once, before or after the call does its work."""

    def __init__(self, engine, where: str, method: str, nth: int = 0, after: bool = False) -> None:
        kv = engine.scheduler.kv
        self.target = kv if where == "kv" else kv.block_pool
        self.method = method
        self.real = getattr(self.target, method)
        self.calls = nth
        self.after = after
        self.fired = False
        setattr(self.target, method, self._call)

    def _call(self, *args, **kwargs):
        if self.fired:
            return self.real(*args, **kwargs)
        if self.calls:
            self.calls -= 1
            return self.real(*args, **kwargs)
        self.fired = True
        if self.after:
            self.real(*args, **kwargs)
        raise InjectedFault(f"injected fault in {self.method}")

    def remove(self) -> None:
        delattr(self.target, self.method)


def make_engine(preemption_mode="swap", num_blocks=16, **config):
    config = EngineConfig(block_size=2, max_num_batched_tokens=12, max_num_seqs=4,
                          preemption_mode=preemption_mode, **config)
    return fake_engine(config, num_blocks=num_blocks, num_host_blocks=6, max_model_len=48)


def busy_engine(preemption_mode="swap"):
    """Prefix sharing, n > 1 forks and preemption all under way within a few steps."""
    engine = make_engine(preemption_mode)
    shared = list(range(30, 36))
    for k, (prompt, n) in enumerate([(shared + [1], 2), (shared + [2], 1), ([7, 8, 9], 1), (shared + [3], 2)]):
        engine.add_request(prompt, SamplingParams(n=n, max_tokens=8, temperature=1.0, seed=k), request_id=f"r{k}")
    return engine


def step_with(engine, fault: Fault | None = None, runner_phase: str | None = None):
    """One step with a fault armed; returns the StepResult, or None if the step raised the injected fault."""
    engine.runner.fault_at = runner_phase
    try:
        return engine.step()
    except InjectedFault:
        return None
    finally:
        engine.runner.fault_at = None
        if fault is not None:
            fault.remove()


@pytest.mark.parametrize("mode, where, method", [
    (mode, where, method) for mode in ("swap", "recompute") for where, method in SCHEDULE_CALLS + UPDATE_CALLS
    if mode == "swap" or "swap" not in method])
@pytest.mark.parametrize("after", [False, True])
def test_a_fault_in_any_call_of_schedule_or_update_leaves_the_cache_consistent(mode, where, method, after):
    reached = 0
    for warmup in range(8):     # fault the first step of the run that reaches this call
        engine = busy_engine(mode)
        for _ in range(warmup):
            engine.step()
        fault = Fault(engine, where, method, after=after)
        result = step_with(engine, fault)
        if fault.fired:
            reached += 1
            assert result is None
            check_invariants(engine)
            finish_and_count(engine)
    assert reached, f"{method} was never called in the first steps"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("phase", RUNNER_PHASES)
def test_a_fault_in_the_runner_fails_the_step_s_requests_and_spares_the_others(phase, mode):
    for warmup in range(8):
        engine = busy_engine(mode)
        for _ in range(warmup):
            engine.step()
        batches = record_batches(engine)
        assert step_with(engine, runner_phase=phase) is None
        check_invariants(engine)
        (batch,) = batches
        requeued = {rid for rid in batch.preempted_request_ids if rid in engine.scheduler.requests}
        assert all(engine.scheduler.requests[rid].status == "waiting" for rid in requeued)
        finals = finish_and_count(engine)
        errors = {rid for rid, output in finals.items() if output.finish_reason == "error"}
        assert errors == {item.request_id for item in batch.items} | set(batch.preempted_request_ids) - requeued
        assert all("InjectedFault" in finals[rid].error for rid in errors)


def finish_and_count(engine) -> dict:
    """Step to the end (every read checked); every request must get exactly one final output."""
    outputs = run_checked(engine)
    finals = Counter(o.request_id for o in outputs if o.finished)
    assert all(count == 1 for count in finals.values()), finals
    return {o.request_id: o for o in outputs if o.finished}


def test_lost_cache_moves_are_not_read_later():
    """The reported bug: an exception before the runner performs a step's swaps and copies."""
    for warmup in range(12):
        engine = busy_engine("swap")
        for _ in range(warmup):
            engine.step()
        assert step_with(engine, runner_phase="moves") is None
        finish_and_count(engine)    # a lost move would make a later read wrong: AssertionError


def test_a_keyboard_interrupt_mid_step_also_leaves_the_cache_consistent():
    engine = busy_engine()
    engine.step()
    kv = engine.scheduler.kv
    real = kv.commit

    def interrupted(*args):
        real(*args)
        raise KeyboardInterrupt

    kv.commit = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    del kv.commit
    check_invariants(engine)
    finals = finish_and_count(engine)
    assert sorted(finals) == ["r0", "r1", "r2", "r3"]


class EngineWithFaults(RuleBasedStateMachine):
    """Random requests, bad inputs, aborts, re-added ids, prefix-cache resets and steps with faults anywhere;
    the pool invariants hold after every rule, every accepted request gets exactly one final output, and the
    kv_events of the steps that returned replay to each one's cached blocks (a failed step's come later)."""

    @initialize(mode=st.sampled_from(["swap", "recompute"]), caching=st.booleans(),
                allocator=st.sampled_from(["paged", "paged", "contiguous"]), blocks=st.integers(8, 14))
    def start(self, mode, caching, allocator, blocks):
        self.engine = make_engine(mode, num_blocks=blocks * (3 if allocator == "contiguous" else 1),
                                  enable_prefix_caching=caching, allocator=allocator)
        self.accepted: set[str] = set()
        self.finals: Counter = Counter()
        self.pending_abort: set[str] = set()    # aborted, final output not reported yet
        self.next_id = 0
        self.replica = KVEventReplica()

    @rule(requests=st.lists(st.tuples(
        st.sampled_from([[], [40, 41, 42, 43], [40, 41, 42, 43, 44, 45]]),
        st.lists(st.integers(0, 255), min_size=1, max_size=5), st.sampled_from([1, 1, 2, 3]),
        st.integers(1, 8), st.sampled_from([0.0, 1.0])), min_size=1, max_size=3))
    def add(self, requests):
        for prefix, suffix, n, max_tokens, temperature in requests:
            request_id = f"q{self.next_id}"
            self.next_id += 1
            params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=self.next_id)
            try:
                self.engine.add_request(prefix + suffix, params, request_id=request_id)
            except RequestError as exc:
                assert "could never fit" in str(exc)
                continue
            self.accepted.add(request_id)

    @rule(index=st.integers(0, len(all_cases()) - 1))
    def add_bad(self, index):
        prompt, params, request_id, message = all_cases()[index][1]
        before = (list(self.engine.scheduler.requests), self.engine.scheduler.kv.block_pool.ref_counts.tolist())
        with pytest.raises(RequestError, match=message):
            self.engine.add_request(prompt, params, request_id=request_id)
        assert before == (list(self.engine.scheduler.requests),
                          self.engine.scheduler.kv.block_pool.ref_counts.tolist())

    @precondition(lambda self: self.accepted)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.accepted)))
        if self.engine.abort_request(request_id):
            self.pending_abort.add(request_id)
            with pytest.raises(RequestError, match="still in use"):
                self.engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id=request_id)

    @rule(fault=st.sampled_from([None] * 16 + [*SCHEDULE_CALLS, *UPDATE_CALLS, *RUNNER_PHASES]),
          nth=st.integers(0, 3), after=st.booleans())
    def step(self, fault, nth, after):
        injected = Fault(self.engine, *fault, nth=nth, after=after) if isinstance(fault, tuple) else None
        result = step_with(self.engine, injected, fault if isinstance(fault, str) else None)
        if result is not None:
            check_invariants(self.engine, result)
            self.replica.step(result)
            self._count(result.outputs)

    @rule()
    def reset_prefix_cache(self):
        idle = self.engine.scheduler.kv.block_pool.num_used_blocks == 0
        cached = dict(self.engine.scheduler.kv.block_pool.cached_blocks)
        assert self.engine.reset_prefix_cache() == idle
        event(f"reset_prefix_cache: {'done' if idle else 'refused'}")
        assert self.engine.scheduler.kv.block_pool.cached_blocks == ({} if idle else cached)

    def _count(self, outputs):
        for output in outputs:
            if output.finished:
                self.finals[output.request_id] += 1
                assert self.finals[output.request_id] == 1, f"{output.request_id} finished twice"
                assert output.request_id in self.accepted
                self.pending_abort.discard(output.request_id)

    @invariant()
    def pool_is_consistent(self):
        if hasattr(self, "engine"):
            check_invariants(self.engine)

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        self._count(run_checked(self.engine, on_step=self.replica.step))
        assert not self.pending_abort
        assert set(self.finals) == self.accepted and all(c == 1 for c in self.finals.values())


TestEngineWithFaults = EngineWithFaults.TestCase
TestEngineWithFaults.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
