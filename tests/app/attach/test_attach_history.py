"""An attached session in the run log: `kvscope runs` lists it, History opens it, Replay steps through it."""

from __future__ import annotations

import pytest
from app_harness import history_on, until, window
from attach_frames import RecordedSource, recorded_server
from test_attach_recorded import timeline

from kvscope.app.attach.feed.run_log import AttachRunLog
from kvscope.app.attach.window.app import AttachApp
from kvscope.app.attach.window.replay_view import VllmReplayScreen, VllmReplayView
from kvscope.app.cli import main
from kvscope.app.runlog import RunLogReader
from kvscope.app.screens.history import HistoryScreen


def logged_session(db) -> RecordedSource:
    """The recorded live session, played back through the data source with the run log on."""
    server = recorded_server()
    run_log = AttachRunLog.open(db, server, interval_s=0.5)
    source = RecordedSource(server, run_log=run_log)
    for _, kind, item in timeline():
        if kind == "events":
            source.apply(0, [item])
        else:
            source.take_sample(item)
    run_log.close()
    return source


def test_the_session_is_a_vllm_run_with_a_step_per_sample(tmp_path, capsys):
    db = tmp_path / "runs.db"
    logged_session(db)
    reader = RunLogReader(db)
    (run,) = reader.list_runs()
    details = reader.run(run["id"])
    assert run["source"] == "vllm" and details["num_steps"] == 73
    assert details["events"]["kv_cleared"] == 1 and details["events"]["kv_removed"] >= 1
    assert details["config"]["preemption_mode"] == "recompute"
    assert details["num_generated_tokens"] > 0 and details["mean_tokens_per_s"] > 0
    last = list(reader.iter_snapshots(run["id"]))[-1]
    assert int((last.snapshot.block_fill == 32).sum()) == 17      # the pool after the reset
    reader.close()
    assert main(["runs", "--db", str(db)]) == 0
    listed = capsys.readouterr().out
    assert "smollm2" in listed and "finished" in listed


def history_app(db) -> AttachApp:
    return AttachApp(RecordedSource(recorded_server()), run_thread=False, db_path=db)


async def open_replay(pilot) -> None:
    await pilot.press("f9")
    await pilot.pause()
    assert isinstance(pilot.app.screen, HistoryScreen)
    await pilot.press("enter")
    await pilot.pause()
    screen = pilot.app.screen
    assert isinstance(screen, VllmReplayScreen)
    screen.jump_to_step(40)
    await pilot.pause()


def test_history_replays_the_session_with_the_attached_panels(tmp_path, snap_compare):
    db = tmp_path / "runs.db"
    logged_session(db)
    assert snap_compare(history_app(db), terminal_size=(140, 40), run_before=open_replay)


@pytest.mark.anyio
async def test_replay_steps_forward_and_back(tmp_path):
    db = tmp_path / "runs.db"
    logged_session(db)
    app = history_app(db)
    async with app.run_test(size=(140, 40)) as pilot:
        await open_replay(pilot)
        screen = app.screen
        view = screen.query_one(VllmReplayView)
        assert screen.steps[screen.index] == 40
        await pilot.press("right")
        await pilot.pause()
        assert screen.steps[screen.index] == 41
        text = view.sample.render().plain
        assert "sample 41" in text and "never swaps" in text and "does not publish per-request rows" in text
        await pilot.press("end")
        await pilot.pause()
        assert int((view.pool_map.snapshot.block_fill == 32).sum()) == 17


@pytest.mark.anyio
async def test_the_apps_own_history_replays_a_watched_run_with_the_attached_panels(tmp_path):
    # History takes its replay from the App that opens it: the engine's App hands it the same choice as the
    # attached window, so a "vllm" run in the shared log replays on the vLLM panels from either window.
    db = tmp_path / "runs.db"
    logged_session(db)
    reader = RunLogReader(db)
    (vllm_run,) = [run["id"] for run in reader.list_runs() if run["source"] == "vllm"]
    reader.close()
    async with window((140, 40), db_path=db, log_enabled=True) as (app, pilot):
        await history_on(pilot, vllm_run, num_runs=2)     # the app's own run and the watched one
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, VllmReplayScreen))
        assert "sample" in app.screen.query_one(VllmReplayView).sample.render().plain
