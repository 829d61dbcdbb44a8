"""SVG snapshots of the main screen, the chat and the explain screen at fixed sizes.

Deterministic by construction: a FakeRunner engine that starts paused and is
single-stepped, a fixed clock for every step's timing, and fixed system figures.
Lessons run on the same engines and stop at their key beats (a lesson's runs are
logged to a temporary file, whose path never shows).
Update with `pytest tests/test_app_snapshots.py --snapshot-update` and look at the SVGs.
"""

from __future__ import annotations

import pytest
from app_harness import FakeEngines, burst_steps, make_app, single_steps, started, type_chat, until

from kvscope.app.lessons import LESSONS
from kvscope.app.lessons.play import play
from kvscope.app.load.presets import PresetContext, build
from kvscope.app.runlog import RunLogReader, record_run
from kvscope.app.screens.replay import ReplayScreen
from kvscope.app.worker.commands import LaunchPreset
from kvscope.engine.config import EngineConfig
from kvscope.engine.fake_runner import fake_engine


def _app(**kwargs):
    return make_app(FakeEngines(fixed_clock=True), **kwargs)


async def _busy_pool(pilot) -> None:
    """A shared system prompt, a chat burst, one request selected, the cursor on a shared block."""
    app = pilot.app
    await started(pilot)
    app.worker.send(LaunchPreset("shared", 3))
    await burst_steps(pilot, 4, 10)
    snapshot = app.main.latest.snapshot
    app.main.view.select_request(snapshot.requests[-1].request_id)
    block_map = app.main.view.block_map
    block_map.focus()
    shared = next(b for b in range(snapshot.num_blocks) if snapshot.ref_counts[b] > 1)
    block_map.move_cursor_to_block(shared)
    app.main.paint(force=True)
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (160, 50)], ids=lambda size: f"{size[0]}x{size[1]}")
def test_main_screen(snap_compare, size):
    assert snap_compare(_app(), terminal_size=size, run_before=_busy_pool)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=lambda size: f"{size[0]}x{size[1]}")
def test_the_requests_key_scrolls_the_queues_into_view(snap_compare, size):
    """R on a window too short for every row (issue 25 defect 4): the view scrolls to the queues."""
    async def to_the_queues(pilot) -> None:
        await _busy_pool(pilot)
        await pilot.press("r")
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=size, run_before=to_the_queues)


async def _two_turn_chat(pilot) -> None:
    app = pilot.app
    await started(pilot)
    chat = app.main.query_one("#chat")
    await type_chat(pilot, "What is a KV cache?")
    await pilot.press("f2")
    await until(pilot, lambda: chat.current_request is None)
    await pilot.press("f2")
    await until(pilot, lambda: app.worker.state.paused)
    await type_chat(pilot, "And why page it?")
    await single_steps(pilot, 5)


def test_chat(snap_compare):
    assert snap_compare(_app(chat_max_tokens=20), terminal_size=(120, 36), run_before=_two_turn_chat)


async def _explain(pilot) -> None:
    await started(pilot)
    await pilot.press("f1")
    await pilot.pause()


def test_explain_screen(snap_compare):
    assert snap_compare(_app(), terminal_size=(100, 30), run_before=_explain)


def _logged_run(path) -> int:
    """A shared system prompt and a chat burst on a FakeRunner engine, recorded as every run is; each
    request joins at the step its preset plans, as the app's engine thread adds them."""
    engine = fake_engine(EngineConfig(block_size=16, num_blocks=128, max_model_len=512), num_host_blocks=32)
    context = PresetContext.from_engine(engine)
    planned = [(item.delay_steps, f"{key}-{i}", item) for key, count in (("shared", 3), ("burst", 4))
               for i, item in enumerate(build(key, count, context))]
    with record_run(engine, db_path=path) as log:
        for step in range(12):
            for _, request_id, item in (p for p in planned if p[0] == step):
                engine.add_request(item.prompt, item.params, request_id=request_id)
            engine.step()
    return log.run_id


def test_replay_screen(snap_compare, tmp_path):
    """The replay draws a logged step in the live window's snapshot view, with the same selection."""
    path = tmp_path / "runs.db"
    run_id = _logged_run(path)

    async def replay_step_ten(pilot) -> None:
        await started(pilot)
        replay = ReplayScreen(RunLogReader(path), run_id)
        await pilot.app.push_screen(replay)
        replay.jump_to_step(10)
        snapshot = replay.frame.snapshot
        replay.view.select_request(snapshot.requests[-1].request_id)
        replay.view.block_map.focus()
        replay.view.block_map.move_cursor_to_block(
            next(b for b in range(snapshot.num_blocks) if snapshot.ref_counts[b] > 1))
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=(160, 48), run_before=replay_step_ten)


# Each lesson's key beats: where the claim is on screen (issue 15).
LESSON_BEATS = [("fragmentation", 0), ("fragmentation", 3), ("fragmentation", 4), ("block-tables", 2),
                ("prefix-sharing", 1), ("prefix-sharing", 3), ("copy-on-write", 1), ("preemption", 0),
                ("preemption", 3), ("chunked-prefill", 1), ("latency", 0), ("latency", 3), ("continuous-batching", 2),
                ("throughput", 1), ("throughput", 2), ("sizing", 0), ("sizing", 1), ("sizing", 5),
                ("sliding-window", 1), ("sliding-window", 2)]
# And every lesson's last beat, where its conclusion is (issue 38): visible at 120x40, or cued on the panel's edge.
LESSON_BEATS += [(name, len(lesson.beats) - 1) for name, lesson in LESSONS.items()
                 if (name, len(lesson.beats) - 1) not in LESSON_BEATS]


@pytest.mark.parametrize("name, beat", LESSON_BEATS, ids=[f"{name}-{beat + 1}" for name, beat in LESSON_BEATS])
def test_lesson_beat(snap_compare, name, beat):
    async def to_the_beat(pilot) -> None:
        await started(pilot)
        await play(pilot, name, stop_at=beat, beat_timeout=60)
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=(120, 40), run_before=to_the_beat)


def test_lesson_beat_replayed_from_the_run_log(snap_compare):
    async def back_one(pilot) -> None:
        await started(pilot)
        await play(pilot, "copy-on-write", stop_at=1, beat_timeout=60)
        await pilot.press("backspace")
        screen = pilot.app.lesson_screen
        await until(pilot, lambda: "replayed" in str(screen.panel.render()))

    assert snap_compare(_app(), terminal_size=(120, 40), run_before=back_one)
