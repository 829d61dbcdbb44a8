"""LLMEngine's public API end to end on the fake runner: outputs, stop rules, bad input, errors, aborts."""

from __future__ import annotations

import inspect
import json
import math
import sqlite3
import subprocess
import sys
import time
import types

import pytest
from invariants import check_invariants, run_checked

from kvscope.engine import EngineConfig, EngineObserver, LLMEngine, RequestError, SamplingParams, llm_engine
from kvscope.engine.fake_runner import FakeRunner, fake_engine
from kvscope.engine.outputs import EventKind, FinishReason, RequestStatus


def make_engine(num_blocks=64, max_model_len=128, **config):
    config.setdefault("block_size", 4)
    runner_kwargs = {k: config.pop(k) for k in ("num_host_blocks", "eos_period", "fail_on") if k in config}
    return fake_engine(EngineConfig(**config), num_blocks=num_blocks, max_model_len=max_model_len,
                       **runner_kwargs)


def greedy(max_tokens=8, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def test_public_attributes():
    engine = make_engine(num_blocks=40)
    assert engine.num_blocks == 40 and isinstance(engine.runner, FakeRunner)
    assert engine.banner.startswith("CPU KV cache size: 160 tokens (40 blocks x 4), Maximum concurrency for")
    assert engine.tokenizer is engine.runner.tokenizer and engine.config.block_size == 4
    assert not engine.has_unfinished_requests()


def test_importing_the_engine_does_not_load_torch_or_transformers(tmp_path):
    code = "import sys, kvscope.engine; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    assert out.strip() == "[]"


def test_generate_returns_final_outputs_in_input_order():
    engine = make_engine()
    prompts = ["hello", [5, 6, 7], "a longer prompt than the others"]
    outputs = engine.generate(prompts, [greedy(3), greedy(5), greedy(1)])
    assert [len(o.token_ids) for o in outputs] == [3, 5, 1]
    assert all(o.finished and o.finish_reason == "length" for o in outputs)
    assert outputs[0].prompt_token_ids == tuple(b"hello")
    assert all(o.text == engine.tokenizer.decode(list(o.token_ids)) for o in outputs)
    check_invariants(engine)


def test_streamed_deltas_add_up_to_the_final_output():
    engine = make_engine(max_num_batched_tokens=8)
    request_id = engine.add_request("stream me please", greedy(12))
    tokens, text, steps = [], "", []
    for output in run_checked(engine):
        tokens.extend(output.new_token_ids)
        text += output.text_delta
        steps.append(output.finished)
    assert tuple(tokens) == output.token_ids and text == output.text
    assert output.request_id == request_id and steps[-1] and not any(steps[:-1])


def test_chat_messages_go_through_the_chat_template():
    engine = make_engine()
    messages = [{"role": "user", "content": "hi"}]
    (output,) = engine.generate([messages], greedy(2))
    expected = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert list(output.prompt_token_ids) == expected


def test_greedy_samples_all_equal_the_single_sample_output():
    engine = make_engine()
    (single,) = engine.generate([[1, 2, 3, 4, 5, 6]], greedy(9))
    (multi,) = engine.generate([[1, 2, 3, 4, 5, 6]], greedy(9, n=3))
    assert [s.token_ids for s in multi.samples] == [single.token_ids] * 3
    assert multi.token_ids == single.token_ids


def test_sampled_outputs_diverge_but_are_reproducible():
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    first = make_engine().generate([[1, 2, 3]], params)[0]
    again = make_engine(num_blocks=12).generate([[1, 2, 3]], params)[0]
    assert len({s.token_ids for s in first.samples}) == 3
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in again.samples]


def test_eos_stops_unless_ignored():
    engine = make_engine(eos_period=5)
    stopped, ignored = engine.generate([[1, 2, 3]] * 2, [SamplingParams(max_tokens=60, temperature=0.0),
                                                         greedy(60)])
    eos = engine.tokenizer.eos_token_id
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos
    assert eos not in stopped.token_ids[:-1] and len(stopped.token_ids) < 60
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 60
    assert ignored.token_ids[:len(stopped.token_ids)] == stopped.token_ids


def test_stop_token_ids_and_stop_strings():
    engine = make_engine()
    (free,) = engine.generate([[9, 9]], greedy(30))
    stop_token = free.token_ids[5]
    first = free.token_ids.index(stop_token)
    (by_token,) = engine.generate([[9, 9]], greedy(30, stop_token_ids=[stop_token]))
    assert by_token.finish_reason == "stop" and by_token.token_ids == free.token_ids[:first + 1]
    stop_text = free.text[10:12]
    (by_string,) = engine.generate([[9, 9]], greedy(30, stop=[stop_text]))
    assert by_string.finish_reason == "stop"
    assert by_string.text == free.text[:free.text.index(stop_text)]
    assert stop_text not in by_string.text
    check_invariants(engine)


@pytest.mark.parametrize("prompt, params, message", [
    ("", None, "prompt is empty"),
    ([], None, "prompt is empty"),
    ([1, 2, 300], None, "vocab_size"),
    (42, None, "prompt must be"),
    ([{"role": "user"}], None, "'content'"),
    ([1] * 100, greedy(40), "max_model_len"),
    ([1] * 10, greedy(100), "num_blocks"),
    ([1] * 10, greedy(20, n=4), "num_blocks"),
    ([1], SamplingParams(max_tokens=0), "max_tokens"),
    ([1], SamplingParams(n=0), "n must"),
    ([1], SamplingParams(temperature=-0.5), "temperature"),
    ([1], SamplingParams(top_p=0.0), "top_p"),
    ([1], SamplingParams(top_p=1.5), "top_p"),
    ([1], SamplingParams(top_k=-2), "top_k"),
    ([1], SamplingParams(stop=["x"], detokenize=False), "stop strings need detokenize"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(prompt, params, message):
    engine = make_engine(num_blocks=16, max_model_len=128)
    engine.add_request([1, 2, 3], greedy(4), request_id="ok")
    engine.step()
    with pytest.raises(RequestError, match=message):
        engine.add_request(prompt, params)
    assert list(engine.scheduler.requests) == ["ok"]
    outputs = run_checked(engine)
    assert [o.request_id for o in outputs if o.finished] == ["ok"]
    assert len(outputs[-1].token_ids) == 4


def test_a_duplicate_request_id_is_refused_until_the_first_finishes():
    engine = make_engine()
    engine.add_request([1, 2], greedy(2), request_id="same")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([3, 4], greedy(2), request_id="same")
    run_checked(engine)
    assert engine.add_request([3, 4], greedy(2), request_id="same") == "same"


def test_generate_refuses_all_or_nothing():
    engine = make_engine()
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.generate([[1, 2], ""], greedy(2))
    assert not engine.has_unfinished_requests()
    assert engine.step().outputs == []
    with pytest.raises(RequestError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[1]], [greedy(), greedy()])


def test_a_failing_request_finishes_with_an_error_and_the_others_go_on():
    engine = make_engine(fail_on=["bad"])
    engine.add_request([1, 2, 3, 4, 5], greedy(6), request_id="good")
    engine.add_request([6, 7, 8, 9, 10], greedy(6, n=2), request_id="bad")
    result = engine.step()
    check_invariants(engine, result)
    bad = next(o for o in result.outputs if o.request_id == "bad")
    assert bad.finished and bad.finish_reason == "error" and bad.error
    assert [s.finish_reason for s in bad.samples] == ["error", "error"]
    assert [e.kind for e in result.events if e.request_id == "bad"] == ["error"]
    assert [r.request_id for r in engine.scheduler.running] == ["good"]
    final = run_checked(engine)[-1]
    assert final.request_id == "good" and final.token_ids == make_engine().generate([[1, 2, 3, 4, 5]],
                                                                                    greedy(6))[0].token_ids


@pytest.mark.parametrize("queue", ["waiting", "running", "swapped"])
def test_abort_in_any_queue_frees_everything(queue):
    engine = make_engine(num_blocks=6, num_host_blocks=16, preemption_mode="swap", max_num_batched_tokens=64)
    engine.add_request(list(range(8)), greedy(12), request_id="a")
    engine.add_request(list(range(20, 28)), greedy(12), request_id="b")
    while engine.scheduler.requests["b"].status != "swapped":
        check_invariants(engine, engine.step())
    engine.add_request([1], greedy(2), request_id="w")     # waits: nothing is admitted while b is swapped
    target = {"waiting": "w", "running": "a", "swapped": "b"}[queue]
    assert engine.scheduler.requests[target].status == queue
    assert engine.abort_request(target)
    assert not engine.abort_request(target) and not engine.abort_request("unknown")
    check_invariants(engine)
    result = engine.step()
    aborted = [o for o in result.outputs if o.request_id == target]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert [e.kind for e in result.events if e.request_id == target] == ["abort"]
    run_checked(engine)


def test_output_does_not_depend_on_preemption_chunking_or_prefix_caching():
    prompts = [list(range(k, k + 9)) for k in range(0, 60, 6)] + [list(range(12))] * 3
    params = [SamplingParams(max_tokens=10 + i % 5, temperature=1.0, seed=i, n=1 + i % 3, ignore_eos=True)
              for i in range(len(prompts))]
    reference = make_engine(num_blocks=4096, max_num_batched_tokens=4096).generate(prompts, params)
    for mode, budget in (("recompute", 7), ("swap", 7), ("swap", 16)):     # swap at 16 also falls back once
        engine = make_engine(num_blocks=22, num_host_blocks=12, preemption_mode=mode,
                             max_num_batched_tokens=budget, max_num_seqs=8)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        final = {o.request_id: o for o in run_checked(engine) if o.finished}
        assert engine.scheduler.num_preemptions > 0
        assert [[s.token_ids for s in final[i].samples] for i in ids] == [
            [s.token_ids for s in o.samples] for o in reference]


def test_snapshot_owns_its_arrays_and_reuses_views_of_untouched_requests():
    engine = make_engine(max_num_seqs=1)
    engine.add_request([1, 2, 3, 4, 5], greedy(6), request_id="runs")
    engine.add_request([6, 7], greedy(2), request_id="waits")
    first = engine.step()
    second = engine.step()
    views = [{v.request_id: v for v in r.snapshot.requests} for r in (first, second)]
    assert views[0]["waits"] is views[1]["waits"]
    assert views[0]["runs"] is not views[1]["runs"]
    assert views[1]["runs"].num_output_tokens == 2 and views[1]["runs"].queue == "running"
    fill_before = first.snapshot.block_fill.copy()
    engine.step()
    assert (first.snapshot.block_fill == fill_before).all()


def test_step_stats_count_tokens_and_metrics_are_ordered():
    engine = make_engine()
    engine.add_request(list(range(10)), greedy(3))
    first = engine.step()
    assert (first.stats.step, first.stats.num_prefill_tokens, first.stats.num_decode_tokens) == (1, 10, 0)
    second = engine.step()
    assert (second.stats.step, second.stats.num_prefill_tokens, second.stats.num_decode_tokens) == (2, 0, 1)
    assert second.stats.generation_tokens_per_s > 0 and second.stats.kv_usage == 3 / 64
    final = run_checked(engine)[-1]
    m = final.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_queue_time_ends_when_the_request_is_scheduled_and_its_prefill_time_spans_the_forward(monkeypatch):
    """vLLM's split of the time to first token: queue time from the arrival (passed in, as a server stamps it
    before handing the request on) to the first scheduling, taken by the scheduler before the forward; prefill
    time from there to the first token, so a forward that takes 50 ms counts there."""
    import time

    engine = make_engine()
    execute = engine.runner.execute

    def slow_execute(batch):
        time.sleep(0.05)
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    arrived = time.time() - 1.0
    engine.add_request(list(range(10)), greedy(2), arrival_time=arrived)
    m = run_checked(engine)[-1].metrics
    assert m.arrival_time == arrived
    assert 1.0 <= m.first_scheduled_time - m.arrival_time < m.first_token_time - m.arrival_time
    assert m.first_token_time - m.first_scheduled_time >= 0.05


@pytest.mark.parametrize("arrival_time", ["now", True, -1.0, 0, float("nan"), "later"])
def test_an_arrival_time_that_is_not_a_past_time_is_refused_and_the_engine_goes_on(arrival_time):
    engine = make_engine()
    engine.add_request(list(range(10)), greedy(3), request_id="running")
    engine.step()
    when = time.time() + 3600 if arrival_time == "later" else arrival_time
    with pytest.raises(RequestError, match="arrival_time") as refused:
        engine.add_request(list(range(10)), greedy(2), arrival_time=when)
    assert refused.value.param == "arrival_time"
    assert [r.request_id for r in engine.scheduler.running] == ["running"] and not engine.scheduler.waiting
    final = run_checked(engine)[-1]
    assert final.request_id == "running" and final.finished and len(final.token_ids) == 3


def test_an_arrival_stamped_by_a_clock_a_little_ahead_is_taken_as_now():
    """A server's thread may read the clock a moment after the engine's, or the clock may be set back between them:
    an arrival under CLOCK_SKEW_S ahead is not refused, and is taken as the moment the engine got the request."""
    engine = make_engine()
    before = time.time()
    engine.add_request(list(range(10)), greedy(2), arrival_time=before + llm_engine.CLOCK_SKEW_S / 2)
    m = run_checked(engine)[-1].metrics
    assert before <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time


def test_every_output_carries_the_metrics_as_they_stand():
    """Each step's output has the request's times as of that step: the first token's from its first output on,
    the finish time only on the final output, whether it finished by length or by an abort."""
    engine = make_engine()
    engine.add_request(list(range(10)), greedy(4), request_id="done")
    engine.add_request(list(range(20, 30)), greedy(50), request_id="aborted")
    seen = {"done": [], "aborted": []}
    for _ in range(8):
        for output in engine.step().outputs:
            seen[output.request_id].append(output)
    engine.abort_request("aborted")
    for output in engine.step().outputs:
        seen[output.request_id].append(output)
    for outputs in seen.values():
        *running, final = outputs
        first = running[0].metrics
        assert first.first_scheduled_time is not None and first.first_token_time is not None
        assert all(o.metrics[:3] == first[:3] and o.metrics.finished_time is None for o in running)
        assert final.finished and final.metrics[:3] == first[:3]
        assert final.metrics.finished_time >= first.first_token_time
    assert seen["aborted"][-1].finish_reason == "abort"


def test_engine_builds_a_model_runner_when_none_is_given(monkeypatch):
    built = {}

    def model_runner(config, model=None, tokenizer=None):
        built["args"] = (config, model, tokenizer)
        return FakeRunner(config, num_blocks=8)

    # Stand in for engine.model.model_runner without importing torch.
    monkeypatch.setitem(sys.modules, "kvscope.engine.model.model_runner",
                        types.SimpleNamespace(ModelRunner=types.SimpleNamespace(built_apart=model_runner)))
    config = EngineConfig(block_size=4)
    engine = LLMEngine(config, model="m", tokenizer=None)
    assert built["args"] == (config, "m", None) and engine.num_blocks == 8


def test_detokenize_false_gives_the_same_tokens_and_no_text():
    prompts = [[5, 6, 7], [8, 9]]
    with_text = make_engine().generate(prompts, greedy(12))
    ids_only = make_engine().generate(prompts, greedy(12, detokenize=False))
    assert [o.token_ids for o in ids_only] == [o.token_ids for o in with_text]
    assert all(o.text for o in with_text)
    assert all(o.text == "" and o.text_delta == "" for o in ids_only)


def test_an_observer_that_raises_is_dropped_and_the_engine_goes_on():
    class Broken:
        def request_added(self, *args):
            pass

        def step(self, result):
            raise OSError("disk full")

    seen = []

    class Counting:
        def request_added(self, request_id, text, num_prompt_tokens, n):
            seen.append((request_id, text, num_prompt_tokens, n))

        def step(self, result):
            seen.append(result.stats.step)

    engine = make_engine()
    broken, counting = Broken(), Counting()
    assert isinstance(counting, EngineObserver)     # a Protocol: any object with its two methods
    engine.add_observer(broken)
    engine.add_observer(counting)
    engine.add_request("hi", greedy(3), request_id="a")
    with pytest.warns(RuntimeWarning, match="disk full"):
        outputs = run_checked(engine)
    assert engine.observers == [counting]
    assert seen == [("a", "hi", 2, 1), *range(1, engine.step_counter + 1)]
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 3


def test_statuses_and_finish_reasons_are_enums_that_read_as_strings():
    engine = make_engine()
    engine.add_request([1, 2, 3], greedy(2), request_id="a")
    view = engine.step().snapshot.requests[0]
    assert view.queue is RequestStatus.RUNNING and view.queue == "running" and f"{view.queue}" == "running"
    results = []
    final = run_checked(engine, on_step=results.append)[-1]
    (finish,) = [e for r in results for e in r.events]
    assert finish.kind is EventKind.FINISH and finish.kind == "finish" and json.dumps(finish.kind) == '"finish"'
    assert final.finish_reason is FinishReason.LENGTH and final.samples[0].finish_reason is FinishReason.LENGTH
    assert final.finish_reason == "length" and str(final.finish_reason) == "length"
    assert json.dumps([final.finish_reason, view.queue]) == '["length", "running"]'
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (x)")
    db.execute("INSERT INTO t VALUES (?)", [final.finish_reason])
    assert db.execute("SELECT x, typeof(x) FROM t").fetchone() == ("length", "text")


def test_step_stats_time_each_phase_of_the_step():
    engine = make_engine()
    engine.add_request(list(range(10)), greedy(3))
    for _ in range(2):
        stats = engine.step().stats
        phases = (stats.schedule_duration, stats.forward_duration, stats.update_duration, stats.snapshot_duration)
        assert all(phase > 0 for phase in phases)
        assert math.isclose(sum(phases), stats.duration, rel_tol=1e-9, abs_tol=1e-9)


def test_the_engine_leaves_blocks_events_and_outputs_to_the_scheduler():
    """The scheduler's update_from_output, abort and fail_step return the outputs: the engine never reopens
    a request the scheduler has just updated."""
    source = inspect.getsource(llm_engine)
    for reach_in in (".kv.", ".kv\n", "block_pool", ".events", "free_sequence", "commit(", ".seqs", "detokenizer",
                     "RequestOutput(", "getattr("):
        assert reach_in not in source, reach_in


def test_the_scheduler_and_the_snapshot_read_the_cache_through_one_call_each():
    """The scheduler hears of the cache's doings through take_events(), the snapshot copies its state through
    cache_state(): neither reaches into the pools."""
    from kvscope.engine import scheduler, snapshot

    for module in (scheduler, snapshot):
        source = inspect.getsource(module)
        for reach_in in ("block_pool", "host_pool", ".evicted", ".copied_on_write"):
            assert reach_in not in source, (module.__name__, reach_in)
