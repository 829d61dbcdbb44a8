"""The window when the engine goes away or the run log is damaged (issue 13, items 9 to 15)."""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager

import numpy as np
import pytest
from app_harness import FakeEngines, make_app, single_steps, started, type_chat, until, window
from runlog_faults import corrupt_snapshot, fill_the_disk, write_garbage_pages

from kvscope.app.runlog import RunLogReader, record_run
from kvscope.app.screens.history import COLUMNS, HistoryScreen
from kvscope.app.screens.quit import ConfirmAbort
from kvscope.app.screens.replay import ReplayScreen
from kvscope.app.widgets.block_map import BlockMap
from kvscope.app.widgets.chat import WAITING, ChatPane
from kvscope.app.widgets.counters import Counters
from kvscope.app.widgets.header import EngineHeader
from kvscope.app.widgets.queues import QueuesTable
from kvscope.app.worker.commands import LaunchPreset
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.outputs import BLOCK_USED

pytestmark = pytest.mark.anyio


def bubbles(app, kind: str) -> list[str]:
    return [str(bubble.render()) for bubble in app.main.query(f".bubble.{kind}")]


def notices(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


async def test_a_rebuild_ends_the_reply_in_the_chat_and_shows_the_new_empty_pool_at_once():
    engines = FakeEngines()
    async with window((160, 48), engines=engines, chat_max_tokens=40) as (app, pilot):
        chat = app.main.query_one(ChatPane)
        await type_chat(pilot, "A question about paging")
        app.worker.send(LaunchPreset("burst", 3))
        await single_steps(pilot, 3)
        map_ = app.main.query_one(BlockMap)
        assert (map_.snapshot.block_state == BLOCK_USED).any() and app.main.query_one(QueuesTable).rows

        await pilot.press("f8")     # prefix caching off: a rebuild, with four requests in flight
        assert isinstance(app.screen, ConfirmAbort)     # which it would abort: asked first
        await pilot.press("y")
        await until(pilot, lambda: not app.main.engine_info.config.enable_prefix_caching)
        await pilot.pause()
        # No step of the new engine has run, and every panel already shows it, not the old one.
        assert engines.built[-1].stats == []
        assert not (map_.snapshot.block_state == BLOCK_USED).any()
        assert app.main.query_one(QueuesTable).rows == {}
        assert app.main.query_one(Counters).stats.num_running == 0
        assert not any(app.main.throughput.history.values())     # no rate of the old engine
        assert chat.current_request is None and chat.messages == []
        assert bubbles(app, "error") == ["⚠ the engine was restarted; ask again"]

        await type_chat(pilot, "Again, then")   # the new engine answers
        await pilot.press("f2")
        await until(pilot, lambda: chat.current_request is None)
        assert chat.messages[-1]["role"] == "assistant"


class SlowStart(FakeEngines):
    """The first build waits until the test lets it finish, as a model loading for a while does."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = threading.Event()

    def __call__(self, config, previous=None):
        if not self.built:
            assert self.loaded.wait(10)
        return super().__call__(config, previous)


async def test_a_question_typed_while_the_model_loads_is_answered_once_it_is_ready():
    engines = SlowStart()
    app = make_app(engines, chat_max_tokens=8, paused=False)     # not window(): it waits for the engine
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: "loading" in str(app.main.query_one(EngineHeader).render()))
        chat = app.main.query_one(ChatPane)
        await type_chat(pilot, "Are you there yet?")
        await pilot.pause()
        assert bubbles(app, "assistant") == [WAITING]
        engines.loaded.set()
        await started(pilot)
        await until(pilot, lambda: chat.current_request is None)
        assert bubbles(app, "error") == []
        assert chat.messages[-1]["role"] == "assistant" and chat.messages[-1]["content"]


class DyingEngines(FakeEngines):
    """has_unfinished_requests raises from the first request on: the engine thread cannot go on."""

    def __call__(self, config, previous=None):
        engine = super().__call__(config, previous)
        real = engine.has_unfinished_requests

        def has_unfinished_requests():
            if engine.scheduler.requests:
                raise RuntimeError("scheduler state lost")
            return real()

        engine.has_unfinished_requests = has_unfinished_requests
        return engine


async def test_when_the_engine_thread_dies_the_window_says_so():
    async with window((160, 48), engines=DyingEngines(), paused=False) as (app, pilot):
        await type_chat(pilot, "hello")
        await until(pilot, lambda: app.engine_died is not None)
        await pilot.pause()
        assert "no engine running" in str(app.main.query_one(EngineHeader).render())
        assert "scheduler state lost" in str(app.main.query_one(EngineHeader).render())
        assert sum("engine thread stopped" in text for text in notices(app)) == 1


async def test_a_failed_rebuild_puts_the_header_back_on_the_engine_that_still_runs():
    engines = FakeEngines()
    async with window((160, 48), engines=engines) as (app, pilot):
        engines.fail_builds = 1
        await pilot.press("f7")
        await until(pilot, lambda: any("could not start the engine" in text for text in notices(app)))
        await pilot.pause()
        header = str(app.main.query_one(EngineHeader).render())
        assert "loading" not in header and "preempt: recompute" in header


async def test_the_run_log_stopping_is_a_toast_and_the_engine_runs_on(tmp_path, monkeypatch):
    path = tmp_path / "runs.db"
    fill_the_disk(monkeypatch, path)
    engines = FakeEngines()
    async with window((160, 48), engines=engines, db_path=path, log_enabled=True, paused=False) as (app, pilot):
        app.worker.send(LaunchPreset("burst", 6))
        await until(pilot, lambda: any(text.startswith("Run log: run log stopped writing") for text in notices(app)))
        steps = len(engines.engine.stats)
        app.worker.send(LaunchPreset("burst", 2))    # the engine serves new work after the log stopped
        await until(pilot, lambda: len(engines.engine.stats) > steps + 5)
    (run,) = RunLogReader(path).list_runs()[:1]
    assert run["status"] == "incomplete"


# --- history and replay over a damaged or partial log ----------------------------------------------


def log_a_run(path, *, steps: int = 30, finish: bool = True) -> int:
    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=256))
    with record_run(engine, db_path=path) as logger:
        for i in range(4):
            engine.add_request("abc" * 10, SamplingParams(max_tokens=20 if finish else 200, ignore_eos=True),
                               request_id=f"r{i}")
        for _ in range(steps):
            engine.step()
    return logger.run_id


async def open_history(pilot, path) -> HistoryScreen:
    pilot.app.db_path = path
    await started(pilot)
    await pilot.press("f9")
    await until(pilot, lambda: isinstance(pilot.app.screen, HistoryScreen))
    await pilot.pause()
    return pilot.app.screen


def summary(screen) -> str:
    return str(screen.query_one("#run-summary").render())


async def test_history_over_garbage_pages_shows_the_error_and_the_app_lives_on(tmp_path):
    path = tmp_path / "runs.db"
    log_a_run(path)
    write_garbage_pages(path, first_page=3)
    async with window((160, 48)) as (app, pilot):
        history = await open_history(pilot, path)
        assert "Cannot read the run log" in summary(history) and "DatabaseError" in summary(history)
        await pilot.press("r")      # reloading fails the same way, quietly
        await pilot.press("escape")
        assert app.screen is app.main and app.is_running


@asynccontextmanager
async def replay_with_a_corrupt_step(tmp_path, step: int):
    """A logged run whose snapshot of ``step`` is damaged, opened from the history (cursor on it, Enter) in a
    started window: yields the app and pilot, with the replay on screen."""
    path = tmp_path / "runs.db"
    run_id = log_a_run(path)
    corrupt_snapshot(path, run_id, step=step)
    async with window((160, 48)) as (app, pilot):
        history = await open_history(pilot, path)
        runs = history.query_one("#runs")
        runs.move_cursor(row=runs.get_row_index(str(run_id)))
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ReplayScreen))
        yield app, pilot


async def test_replay_of_a_corrupt_snapshot_says_which_step_and_the_others_still_show(tmp_path):
    async with replay_with_a_corrupt_step(tmp_path, step=6) as (app, pilot):
        replay = app.screen
        for _ in range(5):
            await pilot.press("right")
        assert replay.frame.stats.step == 6 - 1
        status = str(replay.query_one("#replay-status").render())
        assert "cannot show step 6" in status and "cannot be decoded" in status
        await pilot.press("end")        # every step after it is decoded through it: each says so
        assert replay.frame.stats.step == 5
        await pilot.press("home")
        assert replay.frame.stats.step == 1 and "step 1 " in str(replay.query_one("#replay-status").render())
        await pilot.press("escape", "escape")
        assert app.screen is app.main and app.is_running


async def test_replay_of_a_run_whose_first_frame_is_corrupt_opens_and_says_so(tmp_path):
    async with replay_with_a_corrupt_step(tmp_path, step=1) as (app, pilot):
        await pilot.pause()
        assert "cannot show step 1" in str(app.screen.query_one("#replay-status").render())
        await pilot.press("space")
        await pilot.press("escape", "escape")
        assert app.is_running


async def test_history_counts_every_generated_token_and_an_unfinished_run_is_interrupted(tmp_path):
    path = tmp_path / "runs.db"
    run_id = log_a_run(path, steps=12, finish=False)    # four requests, none finished
    expected = RunLogReader(path).run(run_id)
    assert expected["num_generated_tokens"] == 4 * 12 and expected["num_output_tokens"] is None
    async with window((160, 48)) as (app, pilot):
        history = await open_history(pilot, path)
        runs = history.query_one("#runs")
        await until(pilot, lambda: str(run_id) in runs.rows)
        row = dict(zip(COLUMNS, map(str, runs.get_row(str(run_id))), strict=True))
        assert row["tokens"] == "48" and row["status"] == "interrupted"
        assert "generated tokens 48" in summary(history) and "4 request(s) unfinished" in summary(history)


def test_the_empty_pool_shown_at_start_is_the_engines_own():
    from kvscope.app.widgets.snapshot_view import empty_step
    from kvscope.app.worker.factory import engine_info

    engine = fake_engine(EngineConfig(num_blocks=48, block_size=8, preemption_mode="swap"), num_host_blocks=6)
    info = engine_info(engine)
    snapshot, stats = empty_step(info.runner.num_device_blocks, info.runner.block_size, info.config.allocator,
                                 info.runner.num_host_blocks)
    real = engine.step()    # an idle engine's step changes nothing in the pool
    for name in ("block_state", "ref_counts", "block_fill", "block_hashes"):
        assert np.array_equal(getattr(snapshot, name), getattr(real.snapshot, name)), name
    assert (snapshot.num_host_blocks, snapshot.num_free_host_blocks) == (6, 6)
    assert (stats.num_free_blocks, stats.num_total_blocks) == (48, 48)
