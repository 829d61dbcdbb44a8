"""The engine in a process of its own (app/worker/process.py): the same messages as the engine thread's, over a
pipe; a command that cannot cross refused at once; the process's death told; its run log closed when stopped."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from test_app_worker import Inbox

from kvscope.app.messages import EngineBuildFailed, EngineDied, EngineReady, EngineStepped
from kvscope.app.runlog import RunLogReader, RunLogSpec
from kvscope.app.worker.commands import AddRequest, RunUntil, SetPaused, Stop
from kvscope.app.worker.process import EngineProcess
from kvscope.app.worker.step_posting import MAX_STEPS_AHEAD_OF_UI
from kvscope.app.worker.thread import EngineWorker
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import build_fake_engine

CONFIG = EngineConfig(num_blocks=32, block_size=4, max_model_len=128)
PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10, 11], list(range(20, 41))]
NOT_PICKLABLE = lambda result: True   # noqa: E731 - a lambda bound to a name: pickle finds another object there


def run_process(process: EngineProcess, inbox: Inbox):
    inbox.worker = process
    thread = threading.Thread(target=process.run, daemon=True)
    thread.start()
    return thread


def finals(inbox: Inbox) -> dict[str, tuple]:
    return {o.request_id: tuple(o.token_ids) for m in inbox.of(EngineStepped) for o in m.result.outputs
            if o.finished}


def add_prompts(send) -> None:
    """All of them before the first step: an engine started paused, resumed after the last."""
    for index, prompt in enumerate(PROMPTS):
        send(AddRequest(f"r{index}", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    send(SetPaused(False))


def test_the_engine_process_posts_what_the_engine_thread_posts(tmp_path):
    """Same prompts, same tokens, same steps, as the in-process worker on the same (checked) FakeRunner engine;
    and the run log, written in the engine's process, is closed as finished once it is stopped."""
    alone = Inbox()
    worker = EngineWorker(alone, CONFIG, engine_factory=build_fake_engine, paused=True)
    alone.worker = worker
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    alone.wait_for(lambda: alone.of(EngineReady))
    add_prompts(worker.send)
    alone.wait_for(lambda: len(finals(alone)) == len(PROMPTS))
    worker.send(Stop())
    thread.join(10)

    inbox = Inbox()
    db = tmp_path / "runs.db"
    process = EngineProcess(inbox, CONFIG, engine_factory=build_fake_engine,
                            run_log=RunLogSpec("app", None, str(db), True), paused=True)
    reader_thread = run_process(process, inbox)
    inbox.wait_for(lambda: inbox.of(EngineReady), timeout=120)
    assert inbox.of(EngineReady)[0].run_id is not None
    add_prompts(process.send)
    inbox.wait_for(lambda: len(finals(inbox)) == len(PROMPTS), timeout=60)
    assert finals(inbox) == finals(alone)
    steps = [m.result.stats.step for m in inbox.of(EngineStepped)]
    assert steps == [m.result.stats.step for m in alone.of(EngineStepped)] == list(range(1, len(steps) + 1))

    process.send(SetPaused(True))
    inbox.wait_for(lambda: process.state.paused)
    process.send(Stop())
    reader_thread.join(30)
    assert not reader_thread.is_alive() and not inbox.of(EngineDied)
    (run,) = RunLogReader(db).list_runs()
    assert run["status"] == "finished"


def test_a_command_that_cannot_cross_is_refused_where_it_is_sent_and_the_engine_goes_on():
    inbox = Inbox()
    process = EngineProcess(inbox, CONFIG, engine_factory=build_fake_engine)
    reader_thread = run_process(process, inbox)
    inbox.wait_for(lambda: inbox.of(EngineReady), timeout=120)
    with pytest.raises(TypeError, match="engine process"):
        process.send(RunUntil(lambda result: True, 5))
    with pytest.raises(TypeError, match="engine process"):
        process.send(RunUntil(NOT_PICKLABLE, 5))      # a module-level lambda: pickle's own error, not a TypeError
    with pytest.raises(TypeError, match="not an engine worker command"):
        process.send("step")
    add_prompts(process.send)
    inbox.wait_for(lambda: len(finals(inbox)) == len(PROMPTS), timeout=60)
    process.send(Stop())
    reader_thread.join(30)
    assert not inbox.of(EngineDied)


def test_a_long_run_passes_the_steps_ahead_bound_again_and_again_with_acknowledgements_in_bulk():
    """The window acknowledges in bulk (EngineProcess.ack): an engine that reaches MAX_STEPS_AHEAD_OF_UI steps in
    flight, time after time, is never left waiting; every step arrives, once, in order."""
    steps = 6 * MAX_STEPS_AHEAD_OF_UI
    config = EngineConfig(num_blocks=2 * steps // 4, block_size=4, max_model_len=2 * steps)
    inbox = Inbox()
    process = EngineProcess(inbox, config, engine_factory=build_fake_engine, paused=True)
    reader_thread = run_process(process, inbox)
    inbox.wait_for(lambda: inbox.of(EngineReady), timeout=120)
    process.send(AddRequest("long", [5, 6, 7], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)))
    process.send(SetPaused(False))
    inbox.wait_for(lambda: "long" in finals(inbox), timeout=120)
    assert [m.result.stats.step for m in inbox.of(EngineStepped)] == list(range(1, steps + 1))
    process.send(Stop())
    reader_thread.join(30)
    assert not inbox.of(EngineDied)


def test_an_engine_process_that_dies_is_told_with_how():
    inbox = Inbox()
    process = EngineProcess(inbox, CONFIG, engine_factory=build_fake_engine)
    reader_thread = run_process(process, inbox)
    inbox.wait_for(lambda: inbox.of(EngineReady), timeout=120)
    os.kill(process._process.pid, signal.SIGKILL)
    reader_thread.join(30)
    (died,) = inbox.of(EngineDied)
    assert "killed by signal 9" in died.error
    process.send(SetPaused(False))      # nobody is there: nothing raises


def test_a_first_engine_that_cannot_be_built_is_told_before_the_window_opens(tmp_path):
    process = EngineProcess(None, EngineConfig(model=str(tmp_path / "no-such-model")))
    built = process.wait_until_built(120)
    assert isinstance(built, EngineBuildFailed) and "no-such-model" in built.error
    process.close()
    assert process._process.exitcode == 0


@pytest.mark.anyio
async def test_the_window_and_a_lesson_run_on_an_engine_process(tmp_path):
    """The window draws the process's steps, and a lesson plays to its end: its beats' conditions and loads cross
    to the engine pickled, its engines are rebuilt there, and each beat is logged under the lesson's run."""
    from kvscope.app.app import KVScopeApp
    from kvscope.app.headless import wait_until
    from kvscope.app.lessons.play import play

    app = KVScopeApp(CONFIG, db_path=tmp_path / "runs.db", engine_process=True, engine_factory=build_fake_engine)
    assert isinstance(app.worker.wait_until_built(120), EngineReady)
    async with app.run_test(size=(120, 40)) as pilot:
        assert await wait_until(pilot, lambda: app.main.engine_info is not None, 60)
        add_prompts(app.worker.send)
        assert await wait_until(pilot, lambda: app.main.latest is not None and app.main.latest.stats.step >= 5, 60)
        played = await play(pilot, "block-tables", beat_timeout=60)
        assert all(record.met for record in played.beats), [(r.index, r.run_id, r.step, r.met) for r in played.beats]
        assert len({record.run_id for record in played.beats} - {None}) >= 1
        app.leave_lesson()
        await pilot.pause()
    runs = RunLogReader(tmp_path / "runs.db").list_runs()
    assert {run["source"] for run in runs} >= {"lesson"}


def test_a_run_cut_short_by_the_terminal_closing_is_logged_as_interrupted_saying_so(tmp_path):
    db = tmp_path / "runs.db"
    inbox = Inbox()
    process = EngineProcess(inbox, CONFIG, engine_factory=build_fake_engine,
                            run_log=RunLogSpec("app", None, str(db), True), paused=True)
    reader_thread = run_process(process, inbox)
    inbox.wait_for(lambda: inbox.of(EngineReady), timeout=120)
    add_prompts(process.send)
    inbox.wait_for(lambda: len(finals(inbox)) == len(PROMPTS), timeout=60)
    process.send(Stop("terminal closed"))
    reader_thread.join(30)
    assert process._process.exitcode == 0
    assert_run_ended(db, "interrupted", "terminal closed")


def assert_run_ended(db, status: str, detail: str | None) -> None:
    reader = RunLogReader(db)
    (listed,) = reader.list_runs()
    run = reader.run(listed["id"])
    assert (run["status"], run["status_detail"]) == (status, detail)


WINDOW = """
import os, sys, time
from kvscope.app.runlog import RunLogSpec
from kvscope.app.worker.commands import AddRequest
from kvscope.app.worker.process import EngineProcess
from kvscope.app.worker.step_posting import MAX_STEPS_AHEAD_OF_UI
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import build_fake_engine

if __name__ == "__main__":
    process = EngineProcess(None, EngineConfig(num_blocks=32, block_size=4, max_model_len=128),
                            engine_factory=build_fake_engine, run_log=RunLogSpec("app", None, sys.argv[1], True))
    process.wait_until_built(120)
    process.send(AddRequest("r0", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0)))
    time.sleep(1)
    if sys.argv[2] == "crash":
        os._exit(1)     # no exit handlers: the pipe just closes
    sys.exit(0)         # multiprocessing ends its daemon children with SIGTERM
"""


@pytest.mark.parametrize("how", ["crash", "exit"])
def test_a_window_process_that_goes_leaves_its_run_interrupted_not_running(tmp_path, how):
    import subprocess
    import sys
    import time

    script, db = tmp_path / "window.py", tmp_path / "runs.db"
    script.write_text(WINDOW)
    subprocess.run([sys.executable, str(script), str(db), how], cwd=tmp_path, timeout=180, check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        reader = RunLogReader(db)
        if reader.list_runs() and reader.list_runs()[0]["status"] != "running":
            break
        time.sleep(0.2)
    assert_run_ended(db, "interrupted", "the window closed")


@pytest.mark.anyio
async def test_the_default_model_chats_in_the_window_from_an_engine_process(tmp_path):
    """No flags but --engine-process: the real default model, built in the engine's process, answers the README's
    question in the chat pane, its reply streamed over the pipe."""
    from app_harness import type_chat, until

    from kvscope.app.app import KVScopeApp
    from kvscope.app.widgets.chat import ChatPane

    app = KVScopeApp(EngineConfig(), log_enabled=False, engine_process=True, chat_max_tokens=16)
    assert isinstance(app.worker.wait_until_built(300), EngineReady)
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: app.main.engine_info is not None)
        await type_chat(pilot, "What is the capital of France?")
        chat = app.main.query_one(ChatPane)
        await until(pilot, lambda: chat.current_request is None and len(chat.messages) == 2, timeout=120)
        assert "Paris" in chat.messages[-1]["content"]
