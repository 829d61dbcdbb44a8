"""The engine thread under random commands, bad inputs and injected faults (issue 13, "Done when").

A hypothesis state machine drives an EngineWorker on FakeRunner engines, on the
test's own thread: each rule sends commands, then ``run_once`` applies them and
takes a step when one is due, with a fake clock for the rate cap, so a run is
deterministic and fast. After every engine step the pool invariants are checked
(tests/invariants.py); at the end the worker is drained and shut down, and every
request it was asked for must have exactly one end: one final output, or one
refusal, and nothing after it.

Faults are injected where the worker meets the engine: add_request and step
raising something other than RequestError, the engine factory raising on a
rebuild, the step that ends a replaced engine raising. ``CASES`` counts what was
tried; ``pytest -s`` prints it.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from invariants import check_invariants

from kvscope.app.load.presets import PRESETS
from kvscope.app.messages import (
    CommandRejected,
    EngineBuildFailed,
    EngineFailed,
    EngineReady,
    EngineStepped,
    RequestRejected,
    StepsReady,
)
from kvscope.app.worker.commands import AbortRequest, AddRequest, LaunchPreset, Rebuild, SetPaused, SetRateCap, StepOnce
from kvscope.app.worker.thread import ENGINE_REBUILT, ENGINE_STOPPED, EngineWorker
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine

CASES: collections.Counter = collections.Counter()
CONFIG = EngineConfig(block_size=8, num_blocks=40, max_model_len=160, max_num_seqs=6, max_num_batched_tokens=96)
MAX_DRAIN_STEPS = 4000


class InjectedFault(RuntimeError):
    pass


class FaultyEngine:
    """A fake engine whose next add_request or step raises when the test arms it; every real step
    is checked against the pool invariants."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.fail_add = self.fail_step = False
        self.num_steps = 0

    def add_request(self, prompt, params=None, request_id=None):
        if self.fail_add:
            self.fail_add = False
            raise InjectedFault("injected add_request fault")
        return self._engine.add_request(prompt, params, request_id=request_id)

    def step(self):
        if self.fail_step:
            self.fail_step = False
            raise InjectedFault("injected step fault")
        result = self._engine.step()
        check_invariants(self._engine, result)
        self.num_steps += 1
        return result

    def __getattr__(self, name):
        return getattr(self._engine, name)


class Engines:
    def __init__(self) -> None:
        self.built: list[FaultyEngine] = []
        self.fail_next_build = False

    def __call__(self, config: EngineConfig, previous=None) -> FaultyEngine:
        if self.fail_next_build:
            self.fail_next_build = False
            raise InjectedFault("injected engine build fault")
        engine = FaultyEngine(fake_engine(config, num_host_blocks=24, eos_period=30))
        self.built.append(engine)
        return engine


class Inbox:
    """The app's side: keeps every message, acknowledges each step at once."""

    def __init__(self) -> None:
        self.messages: list = []
        self.worker: EngineWorker | None = None

    def post_message(self, message) -> bool:
        if isinstance(message, StepsReady):    # the steps, taken at once, in the order they came
            for stepped in message.batch.take():
                self.messages.append(stepped)
                self.worker.ack()
        else:
            self.messages.append(message)
        return True

    def of(self, kind) -> list:
        return [m for m in self.messages if isinstance(m, kind)]


good_prompts = st.one_of(
    st.text(alphabet="abcdefgh xyz", min_size=1, max_size=60),
    st.lists(st.integers(0, 255), min_size=1, max_size=60),
    st.builds(lambda text: [{"role": "user", "content": text}], st.text(alphabet="abc ", min_size=1, max_size=30)),
)
good_params = st.builds(
    SamplingParams, n=st.integers(1, 3), max_tokens=st.integers(1, 40),
    temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 3), ignore_eos=st.booleans())

# Inputs the engine must refuse. params as a dict and a prompt of the wrong type used to raise
# AttributeError and TypeError inside add_request, which ended the engine thread.
BAD_ADDS = {
    "empty text": ("", SamplingParams()),
    "None prompt": (None, SamplingParams()),
    "float prompt": (3.5, SamplingParams()),
    "negative token id": ([-1, 2], SamplingParams()),
    "token id past the vocabulary": ([10**12], SamplingParams()),
    "too long for max_model_len": ("x" * 200, SamplingParams(max_tokens=8)),
    "never fits the pool": ("abc", SamplingParams(n=64, max_tokens=150)),
    "max_tokens 0": ("abc", SamplingParams(max_tokens=0)),
    "params as a dict": ("abc", {"max_tokens": 3}),
    "params None-typed fields": ("abc", SamplingParams(temperature=None)),
    "chat message without content": ([{"role": "user"}], SamplingParams()),
}

CONFIG_CHANGES = [
    {}, {"preemption_mode": "swap"}, {"enable_prefix_caching": False}, {"allocator": "contiguous"},
    {"num_blocks": 24}, {"block_size": 16, "num_blocks": 20},
]


class WorkerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        self.engines = Engines()
        self.inbox = Inbox()
        self.worker = EngineWorker(self.inbox, CONFIG, engine_factory=self.engines, clock=lambda: self.clock)
        self.inbox.worker = self.worker
        self.worker.start()
        self.next_id = 0
        self.bad: set[str] = set()
        self.extra_refusals: collections.Counter = collections.Counter()   # duplicates of a live id
        self.aborted: set[str] = set()

    # --- helpers --------------------------------------------------------------------------------

    def run_once(self) -> None:
        self.clock += 1.0
        self.worker.run_once(0)

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def ended(self) -> set[str]:
        ended = {m.request_id for m in self.inbox.of(RequestRejected)}
        ended |= {o.request_id for m in self.inbox.of(EngineStepped) for o in m.result.outputs if o.finished}
        return ended

    def live_ids(self) -> list[str]:
        """Ids the test added that run now: accepted, not ended, not aborted by the test."""
        started = {o.request_id for m in self.inbox.of(EngineStepped) for o in m.result.outputs}
        return sorted(i for i in self.worker._accepted if i in started and i not in self.ended() | self.aborted)

    # --- rules ----------------------------------------------------------------------------------

    @rule(requests=st.lists(st.tuples(good_prompts, good_params), min_size=1, max_size=4))
    def add(self, requests) -> None:
        CASES["add (good input)"] += len(requests)
        for prompt, params in requests:
            self.worker.send(AddRequest(self.new_id(), prompt, params))
        self.run_once()

    @rule(kind=st.sampled_from(sorted(BAD_ADDS)))
    def add_bad(self, kind) -> None:
        CASES[f"bad add: {kind}"] += 1
        request_id = self.new_id()
        self.bad.add(request_id)
        prompt, params = BAD_ADDS[kind]
        self.worker.send(AddRequest(request_id, prompt, params))
        self.run_once()

    @rule(data=st.data())
    def add_duplicate_of_a_live_id(self, data) -> None:
        live = self.live_ids()
        if not live:
            return
        CASES["bad add: id of a request in flight"] += 1
        request_id = data.draw(st.sampled_from(live))
        self.extra_refusals[request_id] += 1
        self.worker.send(AddRequest(request_id, "again", SamplingParams(max_tokens=2)))
        self.run_once()

    @rule(data=st.data())
    def abort(self, data) -> None:
        CASES["abort"] += 1
        candidates = sorted(self.worker._accepted) + ["never-added"]
        request_id = data.draw(st.sampled_from(candidates))
        self.aborted.add(request_id)
        self.worker.send(AbortRequest(request_id))
        self.run_once()

    @rule(paused=st.booleans())
    def pause_or_resume(self, paused) -> None:
        CASES["pause/resume"] += 1
        self.worker.send(SetPaused(paused))
        self.run_once()

    @rule()
    def step_once(self) -> None:
        CASES["single step"] += 1
        self.worker.send(StepOnce())
        self.run_once()

    @rule(cap=st.sampled_from([None, 50.0, 2.0, 0.5]))
    def rate_cap(self, cap) -> None:
        CASES["rate cap"] += 1
        self.worker.send(SetRateCap(cap))
        self.run_once()

    @rule(key=st.sampled_from([*PRESETS, "no-such-preset"]), count=st.integers(-1, 3))
    def preset(self, key, count) -> None:
        valid = key in PRESETS and count >= 1
        CASES["preset" if valid else "bad preset"] += 1
        refused = len(self.inbox.of(CommandRejected))
        self.worker.send(LaunchPreset(key, count))
        self.run_once()
        if not valid and self.worker.engine is not None:
            assert len(self.inbox.of(CommandRejected)) == refused + 1

    @rule(change=st.sampled_from(CONFIG_CHANGES))
    def rebuild(self, change) -> None:
        CASES["rebuild"] += 1
        self.rebuild_to(dataclasses.replace(CONFIG, **change))

    def rebuild_to(self, config: EngineConfig, *, build_fault: bool = False) -> None:
        old = self.worker.engine
        self.engines.fail_next_build = build_fault
        ready = len(self.inbox.of(EngineReady))
        self.worker.send(Rebuild(config))
        self.run_once()
        if build_fault:
            assert self.worker.engine is old and self.inbox.of(EngineBuildFailed)
            return
        assert len(self.inbox.of(EngineReady)) == ready + 1 and self.worker.engine is not old
        old.fail_step = False
        assert not old._engine.scheduler.has_unfinished_requests()
        check_invariants(old._engine)   # no block left behind by the requests it ended

    @rule(kind=st.sampled_from(["add", "step", "build", "last step"]), prompt=good_prompts)
    def inject_fault(self, kind, prompt) -> None:
        engine = self.worker.engine
        if kind == "add":
            CASES["fault: add_request raises"] += 1
            engine.fail_add = True
            self.worker.send(AddRequest(self.new_id(), prompt, SamplingParams(max_tokens=4)))
            self.run_once()
        elif kind == "step":
            CASES["fault: step raises"] += 1
            engine.fail_step = True
            failed = len(self.inbox.of(EngineFailed))
            self.worker.send(StepOnce())
            for _ in range(3):  # a rate cap of 0.5 steps/s may put the step two ticks away
                self.run_once()
            assert len(self.inbox.of(EngineFailed)) == failed + 1 and self.worker.state.paused
        elif kind == "build":
            CASES["fault: engine build raises on a rebuild"] += 1
            self.rebuild_to(CONFIG, build_fault=True)
        else:
            CASES["fault: the replaced engine's last step raises"] += 1
            engine.fail_step = True
            self.rebuild_to(CONFIG)

    @rule(times=st.integers(1, 8))
    def tick(self, times) -> None:
        for _ in range(times):
            self.run_once()

    @invariant()
    def engine_is_consistent(self) -> None:
        if self.worker.engine is not None:
            check_invariants(self.worker.engine._engine)

    # --- the end ----------------------------------------------------------------------------------

    def teardown(self) -> None:
        self.worker.send(SetPaused(False))
        self.worker.send(SetRateCap(None))
        for engine in self.engines.built:
            engine.fail_add = engine.fail_step = False
        for _ in range(MAX_DRAIN_STEPS):
            self.run_once()
            if not self.worker._has_work():
                break
        else:
            raise AssertionError("the worker did not drain")
        in_flight = set(self.worker._accepted)
        self.worker.shutdown()
        self.check_every_request_ended_once(in_flight)
        for engine in self.engines.built:
            assert not engine._engine.scheduler.has_unfinished_requests()
            check_invariants(engine._engine)
        CASES["engine steps checked"] += sum(engine.num_steps for engine in self.engines.built)
        CASES["runs"] += 1

    def check_every_request_ended_once(self, in_flight_at_shutdown: set[str]) -> None:
        events: dict[str, list[tuple[str, object]]] = collections.defaultdict(list)
        for message in self.inbox.messages:
            if isinstance(message, RequestRejected):
                events[message.request_id].append(("refused", message.error))
            elif isinstance(message, EngineStepped):
                for output in message.result.outputs:
                    events[output.request_id].append(("final" if output.finished else "output", output))
        for request_id in [f"r{i}" for i in range(1, self.next_id + 1)]:
            assert request_id in events, f"{request_id} got neither an output nor a refusal"
        for request_id, seen in events.items():
            kinds = [kind for kind, _ in seen]
            finals = [i for i, kind in enumerate(kinds) if kind == "final"]
            expected = 1 + self.extra_refusals[request_id]
            assert len(finals) + kinds.count("refused") == expected, f"{request_id}: {seen}"
            assert len(finals) <= 1, f"{request_id} got two final outputs: {seen}"
            if request_id in self.bad:
                assert kinds == ["refused"], f"bad request {request_id} ran: {seen}"
            if finals:
                assert "output" not in kinds[finals[0]:], f"{request_id} has outputs after its final one: {seen}"
                self.check_abort_reason(request_id, seen[finals[0]][1], in_flight_at_shutdown)
            else:
                assert kinds[-1] == "refused", f"{request_id} has outputs after its refusal: {seen}"

    @staticmethod
    def check_abort_reason(request_id: str, final, in_flight_at_shutdown: set[str]) -> None:
        """A request the worker ended says why: quitting, or a rebuild."""
        if request_id in in_flight_at_shutdown:
            assert (final.finish_reason, final.error) == ("abort", ENGINE_STOPPED)
        elif final.finish_reason == "abort" and final.error is not None:
            assert final.error == ENGINE_REBUILT


WorkerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestWorkerStateful = WorkerMachine.TestCase


@pytest.fixture(autouse=True, scope="module")
def report_cases():
    yield
    print("\nworker state machine, cases tried:")
    for name, count in sorted(CASES.items()):
        print(f"  {name:50} {count:>7,}")
