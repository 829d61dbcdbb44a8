"""Issue 13, items 17-21: the window never shows stale numbers, every key press counts, quitting says so."""

from __future__ import annotations

import threading

import pytest
from app_harness import FakeEngines, burst_steps, make_app, single_steps, started, until, window

from kvscope.app import cli
from kvscope.app.engine_controls import RATE_CAPS
from kvscope.app.runlog import RunLogReader
from kvscope.app.widgets.queues import QueuesTable
from kvscope.app.widgets.throughput import SERIES
from kvscope.app.worker.commands import AbortRequest, LaunchPreset

pytestmark = pytest.mark.anyio


async def test_throughput_falls_to_zero_once_nothing_is_left_to_run():
    app = make_app(FakeEngines(fixed_clock=True))
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        await burst_steps(pilot, 3, 4)
        throughput = app.main.throughput
        assert throughput.current("generation_tokens_per_s") > 0
        await pilot.press("f2")
        await until(pilot, lambda: app.main.latest.snapshot.requests == ())
        app.main.paint(force=True)
        assert throughput.current("generation_tokens_per_s") == 0
        assert throughput.current("prompt_tokens_per_s") == 0
        assert throughput.current("kv") == 0     # the latest step's KV use, as the counters show it
        rows = {series.label: throughput._rows[i][0] for i, series in enumerate(SERIES)}
        assert rows["generate"] == "0 tok/s" and rows["KV use"] == "0 %"
        status = str(app.main.status_lines[0].render())
        assert "Avg generation throughput: 0.0 tokens/s" in status and "Running: 0 reqs" in status


async def test_the_block_map_draws_the_empty_pool_before_the_first_request():
    async with window((120, 36)) as (app, pilot):
        await pilot.pause()
        block_map = app.main.view.block_map
        assert app.main.latest is None                       # no step has run
        assert block_map.map_layout is not None and block_map.map_layout.num_blocks == 128
        assert block_map._codes.size == 128 and block_map.render_line(0).text.strip().startswith("·")
        assert "128 / 128" in str(app.main.view.counters.render())


async def test_enter_in_the_queues_selects_the_first_row_never_a_request_that_is_gone():
    async with window((160, 48)) as (app, pilot):
        await burst_steps(pilot, 4, 2)
        table = app.main.view.queues
        table.focus()
        await pilot.press("down", "down")
        gone = table.cursor_request
        app.main.view.block_map.focus()             # the cursor is no longer drawn
        app.worker.send(AbortRequest(gone))
        await single_steps(pilot, 1)
        assert gone not in [v.request_id for v in app.main.latest.snapshot.requests]
        selected: list[str | None] = []
        app.main.view.select_request = selected.append   # what the view is asked to select
        table.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert selected == [table.order[0]]
        # The cursor's row going while the table has the focus: the cursor moves to a live row.
        await pilot.press("down", "down")
        cursor = table.cursor_request
        app.worker.send(AbortRequest(cursor))
        await single_steps(pilot, 1)
        assert table.cursor_request != cursor and table.cursor_request in table.rows
        await pilot.press("enter")
        await pilot.pause()
        assert selected[-1] == table.cursor_request != cursor


async def test_queue_select_with_no_live_row_selects_nothing():
    async with window((120, 36)) as (app, pilot):
        selected: list[str | None] = []
        app.main.view.select_request = selected.append
        app.main.query_one(QueuesTable).focus()
        await pilot.press("enter")
        await pilot.pause()
        assert selected == []


class BlockedBuild(FakeEngines):
    """The first engine build waits until the test lets it finish: the engine thread takes no command."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.release = threading.Event()

    def __call__(self, config, previous=None):
        self.release.wait(10)
        return super().__call__(config, previous)


async def test_every_f4_press_counts_even_before_the_engine_thread_applied_the_last():
    engines = BlockedBuild()
    app = make_app(engines)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause()
        await pilot.press("f4", "f4", "f4")
        engines.release.set()
        await started(pilot)
        await until(pilot, lambda: app.worker.state.steps_per_s_cap == RATE_CAPS[3])
        await pilot.press("f5")
        await until(pilot, lambda: app.worker.state.steps_per_s_cap == RATE_CAPS[2])


class BlockedStep(FakeEngines):
    """Every step waits until the test lets it finish, as a long prefill keeps the engine thread busy."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.release = threading.Event()
        self.stepping = threading.Event()

    def __call__(self, config, previous=None):
        engine = super().__call__(config, previous)
        step = engine.step

        def blocked_step():
            self.stepping.set()
            self.release.wait(10)
            return step()

        engine.step = blocked_step
        return engine


async def test_quitting_when_idle_says_shutting_down_and_exits_once_the_engine_thread_ended(tmp_path):
    from kvscope.app.screens.quit import ShuttingDown

    app = make_app(FakeEngines(), log_enabled=True, db_path=tmp_path / "runs.db")
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        # A run with a request in it (an empty run is not kept), added while paused so that the window shows it:
        # running, the newest snapshot wins and one that finishes between two renders is never seen in flight.
        app.worker.send(LaunchPreset("burst", 1))
        await until(pilot, lambda: bool(app.main.requests_in_flight()))
        await pilot.press("f2")                         # resume, and let it finish
        await until(pilot, lambda: not app.main.requests_in_flight(), timeout=60)
        app.main.view.block_map.focus()
        await pilot.press("q")
        assert isinstance(app.screen, ShuttingDown)      # idle: no question asked
        await until(pilot, lambda: not app.is_running)
    assert app.engine_thread.is_finished
    reader = RunLogReader(tmp_path / "runs.db")
    assert reader.list_runs()[0]["status"] == "finished"   # closed before the app went
    reader.close()


async def test_quitting_with_work_in_flight_asks_and_waits_for_the_step_in_progress():
    from kvscope.app.screens.quit import ConfirmQuit, ShuttingDown

    engines = BlockedStep()
    app = make_app(engines)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        engines.release.set()
        app.worker.send(LaunchPreset("burst", 2))
        await single_steps(pilot, 1)
        engines.release.clear()
        engines.stepping.clear()
        await pilot.press("f2")             # resume: the next step starts and holds the engine thread
        await until(pilot, engines.stepping.is_set)
        app.main.view.block_map.focus()
        await pilot.press("f10")
        assert isinstance(app.screen, ConfirmQuit)
        await pilot.press("n")
        assert app.screen is app.main and app.is_running
        await pilot.press("q", "y")
        assert isinstance(app.screen, ShuttingDown)
        await pilot.pause(0.2)
        assert app.is_running and isinstance(app.screen, ShuttingDown)   # the step in progress holds it
        assert "Shutting down" in str(app.screen.query_one(".dialog-text").render())
        engines.release.set()
        await until(pilot, lambda: not app.is_running)
    assert app.engine_thread.is_finished


def test_the_console_script_skips_the_interpreter_teardown(monkeypatch):
    """Tearing torch down at exit took 2-4 s on this machine; the command exits as soon as its work is
    done, after the atexit handlers (the run log's among them) have run."""
    calls = []
    monkeypatch.setattr(cli, "main", lambda: 3)
    monkeypatch.setattr(cli.atexit, "_run_exitfuncs", lambda: calls.append("atexit"))
    monkeypatch.setattr(cli.os, "_exit", lambda code: calls.append(("exit", code)))
    cli.console_main()
    assert calls == ["atexit", ("exit", 3)]
