"""A pool with KV-cache groups on screen: w shows one attention kind's blocks at a time (the rest dimmed), the
legend names the kinds, the counters say what each holds and what the window let go of; a pool with one group
has no such key. Asserted on the widgets and on screen (an SVG snapshot at 120x40)."""

from __future__ import annotations

import numpy as np
import pytest
from app_harness import FakeEngines, make_app, shared_and_burst_on_a_focused_map, window

from kvscope.app.widgets import block_cells as cells
from kvscope.engine.block_pool import NULL_BLOCK
from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache_groups import KVCacheGroup

pytestmark = pytest.mark.anyio
GROUPS = (KVCacheGroup((0,), None), KVCacheGroup((1,), 16))
CONFIG = EngineConfig(block_size=4, num_blocks=256, max_model_len=256, max_num_batched_tokens=64)


def _engines():
    return FakeEngines(fixed_clock=True, kv_cache_groups=GROUPS)


async def _decoding(pilot):
    """Requests sharing a system prompt and a chat burst, decoding well past the 16-token window."""
    return await shared_and_burst_on_a_focused_map(pilot, 6)


def _kind_blocks(snapshot, group: int) -> set[int]:
    return {b for view in snapshot.requests for tables in view.group_block_tables for b in tables[group]
            if b != NULL_BLOCK}


async def test_w_shows_one_attention_kind_at_a_time_and_the_legend_and_counters_name_them():
    async with window((120, 40), _engines(), config=CONFIG) as (app, pilot):
        block_map = await _decoding(pilot)
        view = app.main.view
        snapshot = block_map.snapshot
        assert "w: one attention kind" in block_map.border_subtitle
        legend = str(view.legend.render())
        assert "full attention" in legend and "sliding window 16" in legend
        assert view.counters.stats.window_freed_blocks[1] > 0
        text = "\n".join(line.plain for line in view.counters._lines)
        assert "held  full" in text and "window freed" in text
        assert "Groups" in [label for _key, label in app.main.query_one("KeyBar").entries()]

        await pilot.press("w")     # full attention only
        assert block_map.shown_kind == 0 and "full attention only" in block_map.border_subtitle
        codes = block_map._codes
        overlays = np.array([cells.decode(code)[1] for code in codes])
        full, sliding = _kind_blocks(snapshot, 0), _kind_blocks(snapshot, 1)
        assert full and sliding
        layout = block_map.map_layout
        assert layout.blocks_per_cell == 1
        cursor = block_map.cursor_cell     # drawn as the cursor whatever it is on
        assert all(overlays[b] != cells.OVERLAY_DIMMED for b in full)
        assert all(overlays[b] == cells.OVERLAY_DIMMED for b in sliding if b != cursor)

        await pilot.press("w")     # the sliding window only: few blocks per request
        assert block_map.shown_kind == 1 and "sliding window 16 only" in block_map.border_subtitle
        overlays = np.array([cells.decode(code)[1] for code in block_map._codes])
        assert all(overlays[b] != cells.OVERLAY_DIMMED for b in sliding)
        assert all(overlays[b] == cells.OVERLAY_DIMMED for b in full if b != cursor)
        assert "[reverse]" not in legend and "reverse" in str(view.legend.items[-1])

        await pilot.press("w")     # the whole pool again
        assert block_map.shown_kind is None and "w: one attention kind" in block_map.border_subtitle


async def test_a_pool_with_one_group_has_no_group_key():
    async with window((120, 40), FakeEngines(fixed_clock=True), config=CONFIG) as (app, pilot):
        block_map = await _decoding(pilot)
        assert "Groups" not in [label for _key, label in app.main.query_one("KeyBar").entries()]
        await pilot.press("w")
        assert block_map.shown_kind is None and "attention kind" not in block_map.border_subtitle
        assert "groups:" not in str(app.main.view.legend.render())


def test_the_sliding_window_alone_at_120x40(snap_compare):
    async def sliding_only(pilot):
        await _decoding(pilot)
        await pilot.press("w", "w")
        await pilot.pause()

    assert snap_compare(make_app(_engines(), config=CONFIG), terminal_size=(120, 40), run_before=sliding_only)
