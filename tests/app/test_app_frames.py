"""What a frame draws, and what the window does to keep its cost to the engine down.

Nothing here is timed: the frame scheduling runs on a fake clock, and repaints
are counted.
"""

from __future__ import annotations

import gc
import time

import pytest
from app_harness import FakeEngines, burst_steps, make_app, started
from textual.app import App, ComposeResult
from textual.geometry import Region

import kvscope.app.screens.main as main_screen
from kvscope.app.widgets import block_cells as cells
from kvscope.app.widgets.line_panel import LinePanel
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine

pytestmark = pytest.mark.anyio


class FakeClock:
    """Stands in for the ``time`` module in app.screens.main: wall and CPU time move only when told."""

    def __init__(self) -> None:
        self.start = self.wall = time.monotonic() + 1000   # after every frame the app drew on the real clock

    def monotonic(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return 0.0   # no CPU spent: the budget never holds a frame back


def _results(count: int):
    engine = fake_engine(EngineConfig(block_size=16, num_blocks=128, max_model_len=512))
    for i in range(3):
        engine.add_request(list(range(1, 40 + i)), SamplingParams(max_tokens=32), request_id=f"r{i}")
    return [engine.step() for _ in range(count)]


async def test_the_map_shows_every_frames_newest_step_and_the_numbers_follow_at_most_text_rate(monkeypatch):
    clock = FakeClock()
    results = _results(5)
    app = make_app(FakeEngines())
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        monkeypatch.setattr(main_screen, "time", clock)
        main = app.main
        text_period = 1 / main_screen.TEXT_RATE

        def frame(result, at: float) -> tuple[int, int]:
            """Feed one step and paint (no await in between: the app's own timer cannot interleave)."""
            clock.wall = clock.start + at
            if result is not None:
                main.ingest(result)
            main.paint()
            return main.view.block_map.snapshot.step, main.view.counters.stats.step

        first, second, third, fourth = (r.snapshot.step for r in results[:4])
        assert frame(results[0], 0.0) == (first, first)
        assert frame(results[1], 0.05) == (second, first)       # the numbers are not due yet
        assert frame(results[2], 0.10) == (third, first)
        assert frame(results[3], text_period + 0.01) == (fourth, fourth)   # due: drawn with the map
        assert frame(results[4], text_period + 0.06) == (results[4].snapshot.step, fourth)
        # The steps stopped coming: the numbers catch up on a tick of their own.
        assert frame(None, 3 * text_period) == (results[4].snapshot.step, results[4].snapshot.step)
        assert main.view.queues.rows.keys() == {v.request_id for v in results[4].snapshot.requests}


async def test_the_window_freezes_what_its_first_busy_frames_made_once_per_engine(monkeypatch):
    """The first text frames of a busy engine make the window's lasting objects: once SETTLE_FRAMES are drawn
    they are frozen out of the engine thread's full collections, once, and again only for another engine."""
    clock = FakeClock()
    results = _results(main_screen.SETTLE_FRAMES + 3)
    app = make_app(FakeEngines())
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        monkeypatch.setattr(main_screen, "time", clock)
        main = app.main
        frozen = []
        for index, result in enumerate(results):
            clock.wall = clock.start + index       # every frame draws the numbers too
            main.ingest(result)
            main.paint()
            frozen.append(gc.get_freeze_count())
        settle = main_screen.SETTLE_FRAMES - 1
        assert frozen[settle] > frozen[settle - 1]
        # No freeze before the settling frame nor after it: a later freeze would raise the count, while a frozen
        # object that dies (a step's lazily built views let go of their lock) lowers it.
        assert len(set(frozen[:settle])) == 1 and max(frozen[settle:]) == frozen[settle]


class PanelApp(App):
    def compose(self) -> ComposeResult:
        yield LinePanel("step 1\nfree 10\n[b]swap[/b] 0")


async def test_a_line_panel_repaints_only_the_lines_that_changed():
    app = PanelApp()
    async with app.run_test(size=(40, 10)) as pilot:
        panel = app.query_one(LinePanel)
        await pilot.pause()
        refreshed = []
        original = panel.refresh

        def spy(*regions, **options):
            refreshed.append((regions, options))
            return original(*regions, **options)

        panel.refresh = spy
        width = panel.size.width
        panel.show("step 2\nfree 10\n[b]swap[/b] 0")
        assert refreshed == [((Region(0, 0, width, 1),), {})]
        refreshed.clear()
        panel.show("step 2\nfree 10\n[b]swap[/b] 0")
        assert refreshed == []                                   # nothing changed: nothing repainted
        panel.show("step 2\nfree 10\n[i]swap[/i] 0")
        assert refreshed == [((Region(0, 2, width, 1),), {})]   # the same text in a new style is a change
        assert panel.render().plain == "step 2\nfree 10\nswap 0"


async def test_focusing_the_map_shows_its_cursor_at_once_and_leaving_hides_it():
    app = make_app(FakeEngines())
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        await burst_steps(pilot, 2, 1)
        block_map = app.main.view.block_map

        def cursor_shown() -> bool:
            return cells.decode(block_map._codes[block_map.cursor_cell])[1] == cells.OVERLAY_CURSOR

        block_map.focus()
        await pilot.pause()
        assert cursor_shown()          # the engine is paused: no new step redraws the map meanwhile
        app.main.query_one("#chat-input").focus()
        await pilot.pause()
        assert not cursor_shown()
