"""The engine thread on its own: commands in, one message per step out, errors as messages."""

from __future__ import annotations

import threading
import time

import pytest
from app_harness import FakeEngines
from serve_helpers import count_template_calls, tiny_engine

from kvscope.app.messages import (
    CommandRejected,
    EngineBuildFailed,
    EngineDied,
    EngineFailed,
    EngineReady,
    EngineStepped,
    RequestRejected,
    RunStateChanged,
    RunUntilDone,
    StepsReady,
)
from kvscope.app.runlog import RunLogReader, record_run
from kvscope.app.worker.commands import (
    AddChatTurn,
    AddRequest,
    LaunchPreset,
    Rebuild,
    RunUntil,
    SetPaused,
    StepOnce,
    Stop,
)
from kvscope.app.worker.thread import ENGINE_REBUILT, ENGINE_STOPPED, EngineWorker
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine


class Inbox:
    """Stands in for the app: keeps what the worker posts, acknowledges steps at once."""

    def __init__(self) -> None:
        self.messages: list = []
        self.changed = threading.Condition()
        self.worker: EngineWorker | None = None

    def post_message(self, message) -> bool:
        taken = message.batch.take() if isinstance(message, StepsReady) else [message]
        with self.changed:
            self.messages.extend(taken)
            self.changed.notify_all()
        for _ in range(len(taken) if isinstance(message, StepsReady) else 0):
            self.worker.ack()
        return True

    def of(self, kind) -> list:
        with self.changed:
            return [m for m in self.messages if isinstance(m, kind)]

    def wait_for(self, condition, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not condition():
                remaining = deadline - time.monotonic()
                assert remaining > 0, "the worker did not get there in time"
                self.changed.wait(remaining)


def start(engines: FakeEngines, inbox: Inbox | None = None, **kwargs) -> tuple[EngineWorker, Inbox, threading.Thread]:
    inbox = inbox or Inbox()
    config = EngineConfig(num_blocks=64, max_model_len=256)
    worker = EngineWorker(inbox, config, engine_factory=engines, **kwargs)
    inbox.worker = worker
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    inbox.wait_for(lambda: inbox.of(EngineReady))
    return worker, inbox, thread


def stop(worker: EngineWorker, thread: threading.Thread) -> None:
    worker.send(Stop())
    thread.join(5)
    assert not thread.is_alive()


def test_runs_requests_to_completion_handing_over_every_step_in_order():
    engines = FakeEngines()
    worker, inbox, thread = start(engines)
    worker.send(AddRequest("a", "hello there", SamplingParams(max_tokens=5, temperature=0.0)))
    worker.send(AddRequest("b", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0)))
    inbox.wait_for(lambda: sum(o.finished for m in inbox.of(EngineStepped) for o in m.result.outputs) == 2)
    stop(worker, thread)
    steps = [m.result.stats.step for m in inbox.of(EngineStepped)]
    assert steps == [s.step for s in engines.engine.stats]
    assert steps == sorted(set(steps))


class SlowInbox(Inbox):
    """A UI that takes the steps only when it gets round to it (the app does between frames)."""

    def post_message(self, message) -> bool:
        with self.changed:
            self.messages.append(message)
            self.changed.notify_all()
        return True

    def in_order(self) -> list:
        """Every message as the UI handles them: each StepsReady opened into its steps."""
        handled = []
        for message in self.of(object):
            if isinstance(message, StepsReady):
                steps = message.batch.take()
                handled.extend(steps)
                for _ in steps:
                    self.worker.ack()
            else:
                handled.append(message)
        return handled


def test_a_busy_engine_posts_its_steps_in_one_message_until_the_ui_takes_them_and_none_overtakes_a_message():
    engines = FakeEngines()
    worker, inbox, thread = start(engines, SlowInbox())
    worker.send(AddRequest("a", "hello there", SamplingParams(max_tokens=40, temperature=0.0)))
    worker.send(RunUntil(lambda result: False, 30))
    inbox.wait_for(lambda: inbox.of(RunUntilDone))
    stop(worker, thread)
    assert len(inbox.of(StepsReady)) < 30     # was one message per step
    handled = inbox.in_order()
    steps = [m.result.stats.step for m in handled if isinstance(m, EngineStepped)]
    assert steps == [s.step for s in engines.engine.stats][:len(steps)] and len(steps) >= 30
    done = next(i for i, m in enumerate(handled) if isinstance(m, RunUntilDone))
    assert sum(isinstance(m, EngineStepped) for m in handled[:done]) == 30    # its steps come before it


def test_idle_engine_does_not_step():
    engines = FakeEngines()
    worker, inbox, thread = start(engines)
    time.sleep(0.2)
    stop(worker, thread)
    assert inbox.of(EngineStepped) == []


def test_paused_worker_steps_only_on_request():
    engines = FakeEngines()
    worker, inbox, thread = start(engines, paused=True)
    worker.send(AddRequest("a", "x" * 40, SamplingParams(max_tokens=50)))
    worker.send(StepOnce())
    worker.send(StepOnce())
    inbox.wait_for(lambda: len(inbox.of(EngineStepped)) == 2)
    time.sleep(0.2)
    assert len(inbox.of(EngineStepped)) == 2
    worker.send(SetPaused(False))
    inbox.wait_for(lambda: inbox.of(EngineStepped)[-1].result.outputs
                   and inbox.of(EngineStepped)[-1].result.outputs[0].finished)
    stop(worker, thread)
    states = [m.state.paused for m in inbox.of(RunStateChanged)]
    assert states[-1] is False


def test_rejected_request_becomes_a_message_and_the_engine_keeps_serving():
    engines = FakeEngines()
    worker, inbox, thread = start(engines)
    worker.send(AddRequest("too-long", "y" * 400, SamplingParams(max_tokens=8)))
    worker.send(AddRequest("ok", "fine", SamplingParams(max_tokens=4)))
    inbox.wait_for(lambda: any(o.finished and o.request_id == "ok"
                               for m in inbox.of(EngineStepped) for o in m.result.outputs))
    stop(worker, thread)
    rejected = inbox.of(RequestRejected)
    assert [r.request_id for r in rejected] == ["too-long"]
    assert "max_model_len" in rejected[0].error


def test_a_failing_step_pauses_with_an_error_and_resume_goes_on():
    engines = FakeEngines(fail_steps=1)
    worker, inbox, thread = start(engines)
    worker.send(AddRequest("a", "hello", SamplingParams(max_tokens=3)))
    inbox.wait_for(lambda: inbox.of(EngineFailed))
    assert worker.state.paused
    worker.send(SetPaused(False))
    inbox.wait_for(lambda: any(o.finished for m in inbox.of(EngineStepped) for o in m.result.outputs))
    stop(worker, thread)
    assert "simulated engine bug" in inbox.of(EngineFailed)[0].error


def test_shared_prefix_preset_staggers_arrivals_after_the_first_prefill():
    engines = FakeEngines()
    worker, inbox, thread = start(engines, paused=True)
    worker.send(LaunchPreset("shared", 3))
    worker.send(StepOnce())
    inbox.wait_for(lambda: len(inbox.of(EngineStepped)) == 1)
    first = inbox.of(EngineStepped)[0].result.snapshot
    assert [v.request_id for v in first.requests] == ["shared-0"]
    for _ in range(4):
        worker.send(StepOnce())
    inbox.wait_for(lambda: len(inbox.of(EngineStepped)) == 5)
    stop(worker, thread)    # quitting aborts the three: one more step hands out their final outputs
    later = inbox.of(EngineStepped)[4].result.snapshot
    assert {v.request_id for v in later.requests} == {"shared-0", "shared-1", "shared-2"}
    assert any(v.num_cached_tokens > 0 for v in later.requests if v.request_id != "shared-0")


def _record_to(db):
    return lambda engine: record_run(engine, source="app", db_path=db)


def test_rebuild_replaces_the_engine_and_the_log(tmp_path):
    engines = FakeEngines()
    db = tmp_path / "runs.db"
    worker, inbox, thread = start(engines, log_factory=_record_to(db))
    worker.send(AddRequest("a", "abcd", SamplingParams(max_tokens=2)))
    inbox.wait_for(lambda: any(o.finished for m in inbox.of(EngineStepped) for o in m.result.outputs))
    worker.send(Rebuild(EngineConfig(num_blocks=64, max_model_len=256, preemption_mode="swap")))
    inbox.wait_for(lambda: len(inbox.of(EngineReady)) == 2)
    stop(worker, thread)
    assert len(engines.built) == 2
    reader = RunLogReader(db)
    first, second = (reader.run(run["id"]) for run in reversed(reader.list_runs()))
    assert first["status"] == second["status"] == "finished"
    assert second["config"]["preemption_mode"] == "swap"
    (request,) = reader.rows("requests", first["id"])
    assert (request["request_id"], request["prompt_text"], request["num_prompt_tokens"]) == ("a", "abcd", 4)
    assert reader.rows("requests", second["id"]) == []


def test_the_app_logs_a_run_exactly_as_a_script_does(tmp_path):
    """One way to record a run: the worker adds no bookkeeping of its own to what record_run logs."""
    prompts = ["hello there", [70, 71, 72], [{"role": "user", "content": "hi"}]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engines = FakeEngines()
    worker, inbox, thread = start(engines, log_factory=_record_to(tmp_path / "app.db"), paused=True)
    for i, prompt in enumerate(prompts):
        worker.send(AddRequest(str(i), prompt, params))
    worker.send(SetPaused(False))     # all three join the first step, as they do in generate()
    inbox.wait_for(lambda: sum(o.finished for m in inbox.of(EngineStepped) for o in m.result.outputs) == 3)
    stop(worker, thread)

    script_engine = fake_engine(worker.config, num_host_blocks=32)
    with record_run(script_engine, db_path=tmp_path / "script.db"):
        script_engine.generate(prompts, params)

    def logged(db):
        reader = RunLogReader(db)
        (listed,) = reader.list_runs()
        run = reader.run(listed["id"])
        columns = ("request_id", "prompt_text", "num_prompt_tokens", "n", "output_text", "finish_reason")
        requests = [tuple(row[c] for c in columns) for row in reader.rows("requests", run["id"])]
        return requests, len(reader.steps(run["id"])), {k: run[k] for k in ("model", "device", "dtype", "config")}

    app_log, script_log = logged(tmp_path / "app.db"), logged(tmp_path / "script.db")
    assert app_log == script_log
    assert app_log[0][1][1] == "FGH" and app_log[0][2][1] == "user: hi"   # one prompt-text function: the engine's
    assert app_log[2]["config"]["max_model_len"] == 256


def test_only_commands_are_accepted():
    worker = EngineWorker(Inbox(), EngineConfig())
    for wrong in ("pause", ("abort", "a"), None, SamplingParams()):
        with pytest.raises(TypeError, match="not an engine worker command"):
            worker.send(wrong)
    worker.send(SetPaused(True))
    worker.send(LaunchPreset("burst", 2))


# --- issue 13: nothing a command does ends the thread; every request ends once -----------------


def finals(inbox: Inbox) -> dict:
    return {o.request_id: o for m in inbox.of(EngineStepped) for o in m.result.outputs if o.finished}


@pytest.mark.parametrize("prompt, params", [
    ("abc", {"max_tokens": 3}),                     # AttributeError inside add_request
    ("abc", SamplingParams(temperature="hot")),     # TypeError
    ([[1, 2]], SamplingParams()),                   # a list of lists: TypeError
], ids=["params-dict", "params-str-temperature", "nested-token-ids"])
def test_a_malformed_request_is_refused_and_the_thread_serves_the_next(prompt, params):
    worker, inbox, thread = start(FakeEngines())
    worker.send(AddRequest("bad", prompt, params))
    worker.send(AddRequest("ok", "fine", SamplingParams(max_tokens=3)))
    inbox.wait_for(lambda: "ok" in finals(inbox))
    assert thread.is_alive()
    stop(worker, thread)
    assert [r.request_id for r in inbox.of(RequestRejected)] == ["bad"]


class ExplodingAdds(FakeEngines):
    """add_request raises something no refusal is: an engine bug."""

    def __call__(self, config, previous=None):
        engine = super().__call__(config, previous)
        real_add = engine.add_request

        def add_request(prompt, params=None, request_id=None):
            if request_id == "boom":
                raise KeyError("a bug inside the engine")
            return real_add(prompt, params, request_id=request_id)

        engine.add_request = add_request
        return engine


def test_an_engine_bug_in_add_request_refuses_that_request_only():
    worker, inbox, thread = start(ExplodingAdds())
    worker.send(AddRequest("boom", "abc", SamplingParams(max_tokens=3)))
    worker.send(AddRequest("ok", "fine", SamplingParams(max_tokens=3)))
    inbox.wait_for(lambda: "ok" in finals(inbox))
    stop(worker, thread)
    (rejected,) = inbox.of(RequestRejected)
    assert rejected.request_id == "boom" and "KeyError" in rejected.error


def test_a_command_that_raises_is_refused_and_the_thread_goes_on():
    worker, inbox, thread = start(FakeEngines())
    worker.send(LaunchPreset("no-such-preset", 2))
    worker.send(AddRequest("ok", "fine", SamplingParams(max_tokens=3)))
    inbox.wait_for(lambda: "ok" in finals(inbox))
    stop(worker, thread)
    (refused,) = inbox.of(CommandRejected)
    assert refused.command == "LaunchPreset" and "no-such-preset" in refused.error


class DyingEngines(FakeEngines):
    """The engine's has_unfinished_requests raises once a request is in: the thread cannot go on."""

    def __call__(self, config, previous=None):
        engine = super().__call__(config, previous)

        def has_unfinished_requests():
            raise RuntimeError("the engine's state is gone")

        engine._engine.add_request("x", SamplingParams(max_tokens=2))
        engine.has_unfinished_requests = has_unfinished_requests
        return engine


def test_a_dying_thread_says_so():
    inbox = Inbox()
    worker = EngineWorker(inbox, EngineConfig(num_blocks=64, max_model_len=256), engine_factory=DyingEngines())
    inbox.worker = worker
    thread = threading.Thread(target=lambda: pytest.raises(RuntimeError, worker.run), daemon=True)
    thread.start()
    inbox.wait_for(lambda: inbox.of(EngineDied))
    thread.join(5)
    assert "the engine's state is gone" in inbox.of(EngineDied)[0].error


def test_a_rebuild_gives_each_request_in_flight_a_final_output_and_logs_why(tmp_path):
    engines = FakeEngines()
    db = tmp_path / "runs.db"
    worker, inbox, thread = start(engines, log_factory=_record_to(db), paused=True)
    worker.send(AddRequest("a", "abcd", SamplingParams(max_tokens=50)))
    worker.send(AddRequest("b", [5, 6, 7], SamplingParams(max_tokens=50, n=2)))
    worker.send(StepOnce())
    inbox.wait_for(lambda: len(inbox.of(EngineStepped)) == 1)
    worker.send(Rebuild(EngineConfig(num_blocks=64, max_model_len=256, enable_prefix_caching=False)))
    inbox.wait_for(lambda: len(inbox.of(EngineReady)) == 2)
    ended = finals(inbox)
    assert {rid: (o.finish_reason, o.error) for rid, o in ended.items()} == {
        "a": ("abort", ENGINE_REBUILT), "b": ("abort", ENGINE_REBUILT)}
    assert engines.built[0].scheduler.kv.block_pool.num_free_blocks == 64   # nothing left behind
    stop(worker, thread)
    reader = RunLogReader(db)
    first = reader.run(min(run["id"] for run in reader.list_runs()))
    assert first["status"] == "interrupted" and ENGINE_REBUILT in first["status_detail"]
    rows = {row["request_id"]: row for row in reader.rows("requests", first["id"])}
    assert {rid: (row["finish_reason"], row["error"]) for rid, row in rows.items()} == {
        "a": ("abort", ENGINE_REBUILT), "b": ("abort", ENGINE_REBUILT)}
    assert all(row["finish_time"] is not None for row in rows.values())


def test_a_failed_rebuild_keeps_the_engine_and_its_requests():
    engines = FakeEngines()
    worker, inbox, thread = start(engines, paused=True)
    worker.send(AddRequest("a", "abcd", SamplingParams(max_tokens=5)))
    engines.fail_builds = 1
    worker.send(Rebuild(EngineConfig(model="/no/such/model", num_blocks=64, max_model_len=256)))
    inbox.wait_for(lambda: inbox.of(EngineBuildFailed))
    worker.send(SetPaused(False))
    inbox.wait_for(lambda: "a" in finals(inbox))
    stop(worker, thread)
    assert finals(inbox)["a"].finish_reason != "abort"
    assert inbox.of(EngineBuildFailed)[0].still_running is not None


def test_quitting_with_requests_in_flight_ends_them_and_marks_the_run_interrupted(tmp_path):
    db = tmp_path / "runs.db"
    worker, inbox, thread = start(FakeEngines(), log_factory=_record_to(db), paused=True)
    worker.send(AddRequest("a", "abcd", SamplingParams(max_tokens=50)))
    worker.send(StepOnce())
    inbox.wait_for(lambda: len(inbox.of(EngineStepped)) == 1)
    stop(worker, thread)
    assert (finals(inbox)["a"].finish_reason, finals(inbox)["a"].error) == ("abort", ENGINE_STOPPED)
    reader = RunLogReader(db)
    (run,) = reader.list_runs()
    assert run["status"] == "interrupted"
    (row,) = reader.rows("requests", run["id"])
    assert (row["finish_reason"], row["error"]) == ("abort", ENGINE_STOPPED)


# A chat turn from the window is tokenized once: the chat template runs once per turn, and the reply is sized by
# the engine's one fit rule (LLMEngine.reply_room).

def run_turn(engine, max_tokens: int | None) -> list:
    worker, inbox, thread = start(lambda config, previous=None: engine)
    messages = ({"role": "user", "content": "Hello there, how are you?"},)
    worker.send(AddChatTurn("chat-1", messages, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True)))
    inbox.wait_for(lambda: any(o.finished for m in inbox.of(EngineStepped) for o in m.result.outputs))
    stop(worker, thread)
    return [o for m in inbox.of(EngineStepped) for o in m.result.outputs if o.finished]


def test_a_chat_turn_applies_the_chat_template_once():
    engine = tiny_engine()
    calls = count_template_calls(engine)
    (final,) = run_turn(engine, max_tokens=4)
    assert calls == [1] and len(final.samples[0].token_ids) == 4


def test_a_chat_turn_longer_than_the_room_gets_what_is_left_after_its_prompt():
    engine = tiny_engine()
    (final,) = run_turn(engine, max_tokens=10_000)
    assert len(final.prompt_token_ids) + len(final.samples[0].token_ids) == engine.max_request_tokens(1) == 256
