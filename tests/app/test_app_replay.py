"""History and replay screens over a real run log written by a FakeRunner engine."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from app_harness import FakeEngines, history_on, make_app, started, until, window

from kvscope.app.attach.window.replay_view import VllmReplayView
from kvscope.app.load.presets import PresetContext, build
from kvscope.app.runlog import RunLogReader, record_run
from kvscope.app.screens.replay import ReplayScreen, StepView
from kvscope.app.widgets.block_map import BlockMap
from kvscope.app.widgets.counters import Counters
from kvscope.app.widgets.queues import QueuesTable
from kvscope.app.widgets.snapshot_view import SnapshotView
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine

pytestmark = pytest.mark.anyio

NUM_STEPS = 30


@pytest.fixture
def run_log(tmp_path):
    """A logged run of 30 steps: a chat burst on a small pool, so requests come, grow and finish."""
    path = tmp_path / "runs.db"
    config = EngineConfig(num_blocks=64, max_model_len=256)
    engine = fake_engine(config, num_host_blocks=8)
    context = PresetContext(16, 64, 256, config.max_num_batched_tokens, lambda text: len(text.encode()))
    with record_run(engine, db_path=path) as logger:
        assert logger.enabled, logger.warning
        for i, planned in enumerate(build("burst", 5, context)):
            engine.add_request(planned.prompt, planned.params, request_id=f"r{i}")
        for _ in range(NUM_STEPS):
            engine.step()
    return path, logger.run_id


async def test_history_lists_the_run_and_replay_shows_the_recorded_steps(run_log):
    path, run_id = run_log
    reader = RunLogReader(path)
    try:
        recorded = reader.steps(run_id)
        tenth = reader.snapshot_at(run_id, recorded[9].step)
    finally:
        reader.close()
    # The app logs its own run into the same file; the history lists it first (newest).
    app = make_app(FakeEngines(), db_path=path, log_enabled=True)
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        history = await history_on(pilot, run_id, num_runs=2)     # the app's own run and the logged one
        assert "Run" in str(history.query_one("#run-summary").render())
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ReplayScreen))
        replay = app.screen
        assert replay.query_one(Counters).stats == recorded[0]

        await pilot.press("right")
        assert replay.query_one(Counters).stats == recorded[1]

        await pilot.press("g")
        await pilot.press(*str(recorded[9].step), "enter")
        assert replay.frame.stats == recorded[9]
        shown = replay.query_one(BlockMap).snapshot
        assert np.array_equal(shown.block_state, tenth.snapshot.block_state)
        assert shown.requests == tenth.snapshot.requests
        table = replay.query_one(QueuesTable)
        assert set(table.rows) == {v.request_id for v in tenth.snapshot.requests}

        await pilot.press("plus", "minus")
        await pilot.press("space")
        assert replay.playing
        await until(pilot, lambda: replay.index >= 11)
        await pilot.press("space")
        assert not replay.playing and replay.index < len(recorded) - 1
        assert replay.frame.stats == recorded[replay.index]

        await pilot.press("escape", "escape")
        assert app.screen is app.main


async def test_history_without_a_log_says_so(tmp_path):
    app = make_app(FakeEngines(), db_path=tmp_path / "none.db", log_enabled=False)
    app.db_path = tmp_path / "none.db"
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        await pilot.press("f9")
        assert "No run log yet" in str(app.screen.query_one("#run-summary").render())


def test_both_step_views_are_what_the_replay_draws_with():
    # StepView is the interface in code: the live view and the watched server's view both implement it, with
    # show()'s exact signature, so a change to one that the replay would trip over fails here.
    for view in (SnapshotView(), VllmReplayView()):
        assert isinstance(view, StepView), type(view).__name__
        assert inspect.signature(type(view).show) == inspect.signature(StepView.show), type(view).__name__


async def test_after_a_jump_the_recently_finished_rows_are_the_ones_the_live_window_showed(tmp_path):
    """Issue 25 defect 6: after End, "chat-6 ✓ done 56/256" where chat-6 had finished "stop" at 89 tokens, and the
    request that finished at that step was missing."""
    path = tmp_path / "runs.db"
    engine = fake_engine(EngineConfig(num_blocks=128, max_model_len=256), eos_period=23)
    with record_run(engine, db_path=path) as logger:
        for i in range(6):
            engine.add_request(f"question number {i}", SamplingParams(max_tokens=40 + 5 * i, seed=i),
                               request_id=f"chat-{i}")
        while engine.has_unfinished_requests():
            engine.step()
    reader = RunLogReader(path)
    ended = {row["request_id"]: row for row in reader.rows("requests", logger.run_id)}
    async with window((160, 48)) as (app, pilot):
        replay = ReplayScreen(reader, logger.run_id)
        await app.push_screen(replay)
        await pilot.press("end")
        await pilot.pause()
        table = replay.view.queues
        shown = {rid: table.finished[rid][0] for rid in table.finished}
        assert shown, "no recently finished rows after End"
        last_step = replay.steps[-1]
        assert any(step == last_step for _, step in table.finished.values())   # the one that ended right there
        for rid, row in shown.items():
            logged = ended[rid]
            assert row[1] == {"stop": "✓ stop", "length": "✓ length"}[logged["finish_reason"]], (rid, row)
            assert row[4].startswith(f"{logged['num_output_tokens']}/"), (rid, row, logged)
        await pilot.press("home")                                    # and back: nothing has finished at step 1
        await pilot.pause()
        assert not table.finished
    reader.close()


@pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=lambda size: f"{size[0]}x{size[1]}")
async def test_the_history_list_shows_every_column_whole(tmp_path, size):
    """Issue 25 defect 10: at 120 columns the model read "SmolL" beside empty space and the status "fi"."""
    from cli_helpers import log_run

    path = tmp_path / "runs.db"
    for seed in range(2):
        log_run(path, 20, seed, model="SmolLM2-135M-Instruct")
    app = make_app(FakeEngines(), db_path=path, log_enabled=True)
    async with app.run_test(size=size) as pilot:
        await started(pilot)
        await pilot.press("f9")
        runs = app.screen.query_one("#runs")
        await until(pilot, lambda: runs.row_count >= 2 and len(runs.columns) == 8)
        await pilot.pause()
        assert runs.virtual_size.width <= runs.scrollable_content_region.width    # nothing off to the right
        row = [str(cell) for cell in runs.get_row_at(runs.row_count - 1)]
        assert row[1] == "finished" and row[-1].startswith("SmolLM2-135M")      # whole status, most of the name
