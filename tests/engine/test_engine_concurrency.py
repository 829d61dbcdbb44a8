"""Aborts reach the caller, a request id stays in use until its final output is out, and add_request and
abort_request are safe from any thread while another thread steps."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter

import pytest
from invariants import check_invariants, run_checked

from kvscope.engine import EngineConfig, RequestError, SamplingParams
from kvscope.engine.fake_runner import fake_engine


def make_engine(**config):
    config.setdefault("block_size", 4)
    return fake_engine(EngineConfig(**config), num_blocks=64, max_model_len=128)


def greedy(max_tokens=6):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drain(engine) -> list:
    """The loop every caller writes."""
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step().outputs)
    return outputs


@pytest.mark.parametrize("steps_before", [0, 1])
def test_a_step_loop_receives_the_final_output_of_an_aborted_request(steps_before):
    engine = make_engine()
    engine.add_request([1, 2, 3], greedy(), request_id="only")
    for _ in range(steps_before):
        engine.step()
    assert engine.abort_request("only")
    assert engine.has_unfinished_requests()     # its final output is still to come
    outputs = drain(engine)
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [("only", True, "abort")]
    check_invariants(engine)


def test_an_aborted_id_is_in_use_until_its_final_output_is_reported():
    engine = make_engine()
    engine.add_request([1, 2, 3], greedy(), request_id="x")
    engine.step()
    engine.abort_request("x")
    with pytest.raises(RequestError, match="still in use"):
        engine.add_request([4, 5, 6], greedy(), request_id="x")
    first = engine.step().outputs
    assert [(o.request_id, o.finish_reason) for o in first] == [("x", "abort")]
    assert engine.add_request([4, 5, 6], greedy(3), request_id="x") == "x"
    again = drain(engine)
    assert [o.finish_reason for o in again if o.request_id == "x"] == [None, None, "length"]
    assert again[-1].prompt_token_ids == (4, 5, 6)


def test_generate_withdraws_its_requests_when_a_step_raises():
    engine = make_engine()
    engine.runner.fault_at = "forward"
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.generate([[1, 2], [3, 4]], greedy())
    assert not engine.has_unfinished_requests()
    check_invariants(engine)
    assert engine.generate([[1, 2]], greedy(2))[0].finish_reason == "length"


def test_calls_from_other_threads_wait_for_the_step_in_progress():
    engine = make_engine()
    engine.add_request([1, 2, 3], greedy(), request_id="a")
    inside, release = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def slow_execute(batch):
        inside.set()
        assert release.wait(10)
        return execute(batch)

    engine.runner.execute = slow_execute
    stepping = threading.Thread(target=engine.step)
    stepping.start()
    assert inside.wait(10)
    callers = [threading.Thread(target=engine.add_request, args=([7, 8], greedy()), kwargs={"request_id": "b"}),
               threading.Thread(target=engine.abort_request, args=("a",))]
    for caller in callers:
        caller.start()
    callers[0].join(0.2)
    assert callers[0].is_alive() and list(engine.scheduler.requests) == ["a"]     # waiting for the step
    release.set()
    for thread in (stepping, *callers):
        thread.join(10)
    del engine.runner.execute
    finals = {o.request_id: o.finish_reason for o in drain(engine) if o.finished}
    assert finals == {"a": "abort", "b": "length"}


def test_step_from_inside_an_observer_is_refused():
    engine = make_engine()

    class Restepping:
        def request_added(self, *args):
            pass

        def step(self, result):
            engine.step()

    engine.add_observer(Restepping())
    engine.add_request([1, 2], greedy(2))
    with pytest.warns(RuntimeWarning, match="called from inside step"):
        engine.step()
    assert not engine.observers
    run_checked(engine)


def test_adding_and_aborting_from_many_threads_while_one_thread_steps():
    engine = make_engine(max_num_seqs=16, max_num_batched_tokens=64)
    accepted: list[str] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def produce(worker: int) -> None:
        rng = random.Random(worker)
        try:
            for k in range(60):
                request_id = f"{worker}-{k}"
                engine.add_request([rng.randrange(256) for _ in range(rng.randint(1, 12))],
                                   SamplingParams(n=rng.choice([1, 1, 2]), max_tokens=rng.randint(1, 8),
                                                  temperature=1.0, seed=k), request_id=request_id)
                accepted.append(request_id)
                if rng.random() < 0.5:     # most likely running: the step in progress holds it
                    engine.abort_request(f"{worker}-{max(0, k - rng.randrange(4))}")
                time.sleep(rng.random() / 1000)
        except BaseException as exc:
            errors.append(exc)

    producers = [threading.Thread(target=produce, args=(w,)) for w in range(4)]
    finals: Counter = Counter()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)     # hand the GIL over as often as possible: races show at once
    try:
        for producer in producers:
            producer.start()
        threading.Thread(target=lambda: [p.join() for p in producers] and None or done.set()).start()
        while not done.is_set() or engine.has_unfinished_requests():
            finals.update(o.request_id for o in engine.step().outputs if o.finished)
    finally:
        sys.setswitchinterval(switch)
    assert not errors
    check_invariants(engine)
    assert set(finals) == set(accepted) and all(count == 1 for count in finals.values())
