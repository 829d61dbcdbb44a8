"""A pool far larger than the panel stays explorable: z zooms the map into the blocks around the cursor and f
shows the selected request's blocks, one cell per block; Esc (or the same key) goes back to the whole pool.
Asserted on the widget and on screen (SVG snapshots at 120x40)."""

from __future__ import annotations

import numpy as np
import pytest
from app_harness import FakeEngines, make_app, shared_and_burst_on_a_focused_map, window

from kvscope.engine.config import EngineConfig

pytestmark = pytest.mark.anyio
BIG_POOL = EngineConfig(block_size=16, num_blocks=40_000, max_model_len=2048)


def _app():
    return make_app(FakeEngines(fixed_clock=True), config=BIG_POOL)


async def _busy_big_pool(pilot):
    """Three requests sharing a system prompt on a pool of 40,000 blocks, the map focused, its cursor on the
    last request's last block."""
    block_map = await shared_and_burst_on_a_focused_map(pilot, 4)
    view = pilot.app.main.latest.snapshot.requests[-1]
    block_map.move_cursor_to_block(view.block_tables[0][-1])
    await pilot.pause()
    return block_map, view


async def test_zoom_shows_one_cell_per_block_around_the_cursor_and_esc_goes_back():
    async with window((120, 40), FakeEngines(fixed_clock=True), config=BIG_POOL) as (_, pilot):
        block_map, view = await _busy_big_pool(pilot)
        assert block_map.map_layout.blocks_per_cell > 1
        cursor_block = view.block_tables[0][-1]
        under_cursor = block_map.cell_blocks(block_map.cursor_cell)    # the cell of many blocks holding it
        assert cursor_block in under_cursor
        await pilot.press("z")
        assert block_map.map_layout.blocks_per_cell == 1
        shown = block_map.shown_blocks
        assert shown[0] <= cursor_block <= shown[-1] and np.array_equal(shown, np.arange(shown[0], shown[-1] + 1))
        assert block_map.cell_blocks(block_map.cursor_cell) == [under_cursor[0]]   # the cursor's cell, opened
        assert "1 cell = 1 block" in block_map.border_subtitle
        await pilot.press("down")    # from the region's last row: the region moves on by a row
        start = block_map.zoom_start
        for _ in range(block_map.map_layout.num_rows):
            await pilot.press("down")
        assert block_map.zoom_start > start
        await pilot.press("escape")
        assert block_map.shown_blocks is None and block_map.map_layout.blocks_per_cell > 1


async def test_focus_shows_the_selected_requests_blocks_in_table_order():
    async with window((120, 40), FakeEngines(fixed_clock=True), config=BIG_POOL) as (app, pilot):
        block_map, view = await _busy_big_pool(pilot)
        app.main.view.select_request(view.request_id)
        await pilot.press("f")
        assert block_map.shown_blocks.tolist() == list(view.block_tables[0])
        assert block_map.map_layout.blocks_per_cell == 1
        assert view.request_id in block_map.border_subtitle
        await pilot.press("f")
        assert block_map.shown_blocks is None


def test_zoomed_big_pool_on_screen(snap_compare):
    async def zoomed(pilot) -> None:
        await _busy_big_pool(pilot)
        await pilot.press("z")
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=(120, 40), run_before=zoomed)


def test_focused_request_on_screen(snap_compare):
    async def focused(pilot) -> None:
        _, view = await _busy_big_pool(pilot)
        pilot.app.main.view.select_request(view.request_id)
        await pilot.press("f")
        await pilot.pause()

    assert snap_compare(_app(), terminal_size=(120, 40), run_before=focused)
