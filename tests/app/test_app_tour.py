"""What a newcomer's tour at 120x40, 80x24 and 200x60 tripped on: toasts under the footer, lines that wrapped
mid-figure, the served address only in a toast that times out."""

from __future__ import annotations

import pytest
from app_harness import FakeEngines, burst_steps, make_app, started, until, window
from textual.widgets import DataTable
from textual.widgets._toast import Toast

from kvscope.app.runlog import record_run
from kvscope.app.screens.history import HistoryScreen
from kvscope.app.widgets.counters import Counters
from kvscope.app.widgets.header import EngineHeader
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine

pytestmark = pytest.mark.anyio


class QuietServe:
    """What the App asks of kvscope --serve's HostedServe, serving nothing."""

    url = "http://127.0.0.1:8123"
    wake = None

    def network_warning(self) -> None:
        return None

    def engine_installed(self, engine) -> None:
        pass

    def run_pending(self) -> None:
        pass

    def close(self) -> None:
        pass


async def test_toasts_stand_above_the_status_line_and_the_address_stays_in_the_header():
    app = make_app(FakeEngines(), serve=QuietServe())
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await started(pilot)
        await until(pilot, lambda: app.screen.query(Toast))
        await pilot.pause()
        status = app.main.query_one("#vllm-status")
        for toast in app.screen.query(Toast):
            assert toast.region.bottom <= status.region.y, "a toast is drawn over the status line"
        header = str(app.main.query_one(EngineHeader).render())
        assert "serving http://127.0.0.1:8123/v1" in header


@pytest.mark.parametrize("width", [80, 120, 200])
async def test_the_header_breaks_only_between_its_facts(width):
    app = make_app(FakeEngines(), serve=QuietServe())
    async with app.run_test(size=(width, 40)) as pilot:
        await started(pilot)
        header = app.main.query_one(EngineHeader)
        await pilot.pause()
        lines = str(header.render()).split("\n")
        assert len(lines) <= 3 and all(len(line) <= header.size.width for line in lines)
        for line in lines[1:]:
            assert not line.startswith(("MiB", "tok", "x@", "prefix")), lines    # no figure cut from its unit


@pytest.fixture
def many_runs(tmp_path):
    """A run log of 40 short runs: more than History's list shows at 120x40."""
    path = tmp_path / "runs.db"
    for _ in range(40):
        engine = fake_engine(EngineConfig(num_blocks=32, max_model_len=128))
        with record_run(engine, db_path=path, label="a-long-label-for-the-model-column"):
            engine.add_request("hello there", SamplingParams(max_tokens=2))
            while engine.has_unfinished_requests():
                engine.step()
    return path


async def test_history_end_and_home_move_the_selection_and_every_column_fits(many_runs):
    async with window((120, 40), db_path=many_runs, log_enabled=True) as (app, pilot):
        await pilot.press("f9")
        history = app.screen
        assert isinstance(history, HistoryScreen)
        table = history.query_one("#runs", DataTable)
        await until(pilot, lambda: table.row_count >= 40)
        table.focus()
        await pilot.press("end")
        await pilot.pause()
        assert table.cursor_row == table.row_count - 1
        assert history.run_id == int(table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value)
        await pilot.press("home")
        await pilot.pause()
        assert table.cursor_row == 0
        assert table.max_scroll_x == 0, "the last column runs past the panel"


async def test_the_counters_never_wrap_a_line_at_120_columns():
    config = EngineConfig(block_size=16, num_blocks=5825, max_model_len=512)
    async with window((120, 40), config=config) as (app, pilot):
        await burst_steps(pilot, 4, 12)
        counters = app.main.query_one(Counters)
        await until(pilot, lambda: counters.stats is not None)
        await pilot.pause()
        width = counters.scrollable_content_region.width
        lines = str(counters.render()).split("\n")
        assert all(len(line) <= width for line in lines), lines
        assert any("cached" in line for line in lines)


@pytest.mark.parametrize(("name", "reason"), [("SIGHUP", "terminal closed"), ("SIGTERM", "terminated (SIGTERM)")],
                         ids=["the terminal closed", "kill"])
async def test_a_signal_that_ends_the_app_logs_the_run_interrupted_not_crashed(tmp_path, name, reason):
    import os
    import signal

    from kvscope.app.runlog import RunLogReader

    path = tmp_path / "runs.db"
    number = getattr(signal, name)
    async with window((120, 40), db_path=path, log_enabled=True) as (app, pilot):
        await burst_steps(pilot, 2, 3)
        # Its default would end this test's process: only send it once the app has its own handler.
        assert signal.getsignal(number) not in (signal.SIG_DFL, signal.default_int_handler)
        run_id = app.run_id
        os.kill(os.getpid(), number)
        await until(pilot, lambda: not app.is_running or app.engine_thread.is_finished)
    assert signal.getsignal(number) is signal.SIG_DFL     # the app's handler went with it
    reader = RunLogReader(path)
    try:
        run = reader.run(run_id)
    finally:
        reader.close()
    assert (run["status"], run["status_detail"]) == ("interrupted", reason)


async def test_the_palette_has_an_entry_per_load_preset_that_sends_it():
    from kvscope.app.load.presets import PRESETS
    from kvscope.app.widgets.load_generator import LoadGenerator

    async with window((120, 40)) as (app, pilot):
        commands = {command.title: command for command in app.get_system_commands(app.screen)}
        assert all(f"Load: {preset.title}" in commands for preset in PRESETS.values())
        last = list(PRESETS.values())[-1]
        commands[f"Load: {last.title}"].callback()
        await until(pilot, lambda: app.main.requests_in_flight())
        assert app.main.query_one(LoadGenerator).preset_key == last.key


async def test_the_replays_jump_box_leaves_the_queues_whole_and_its_status_keeps_one_row(tmp_path):
    from kvscope.app.load.presets import PresetContext, build
    from kvscope.app.runlog import RunLogReader
    from kvscope.app.screens.replay import ReplayScreen
    from kvscope.app.widgets.block_map import BlockMap
    from kvscope.app.widgets.queues import QueuesTable

    path = tmp_path / "runs.db"
    config = EngineConfig(num_blocks=64, max_model_len=256)
    engine = fake_engine(config, num_host_blocks=8)
    context = PresetContext(16, 64, 256, config.max_num_batched_tokens, lambda text: len(text.encode()))
    with record_run(engine, db_path=path) as logger:
        for i, planned in enumerate(build("burst", 5, context)):
            engine.add_request(planned.prompt, planned.params, request_id=f"r{i}")
        for _ in range(30):
            engine.step()
    async with window((120, 40)) as (app, pilot):
        await app.push_screen(ReplayScreen(RunLogReader(path), logger.run_id))
        await pilot.pause()
        replay = app.screen
        queues = replay.query_one(QueuesTable)
        scales = set()
        for _ in range(30):
            await pilot.press("right")
            await pilot.pause()
            assert replay.query_one("#replay-status").region.height == 1
            scales.add(replay.query_one(BlockMap).border_subtitle)
        assert len(scales) == 1, scales                         # the map's scale never flips
        assert not replay.query_one("#jump").region.overlaps(queues.region)
        assert queues.region.height >= 5 + 2                    # every request's row, and the header
