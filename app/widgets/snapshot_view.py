"""SnapshotView: the engine's state at one step, in every panel that draws it, wired together.

The live window, the replay screen (and anything else that shows a snapshot:
a lesson, an attached vLLM server) use this one widget, so a block map, its
legend and inspector, the counters, the paged-vs-contiguous comparison, the
block table, the queues and the event line under the map (what the step did,
in words) look and behave the same everywhere. Selecting a
request (in the queues or the map) highlights its blocks in the map and the
block table; moving the map's cursor shows that block in the inspector. The
view handles both messages itself and stops them there.

The layout is three rows: the map column on top, the figures under it, the
queues and the block table at the bottom. A window too short for all three
(120x40) scrolls: the top row keeps what the first screen leaves after the
figures, and the bottom row's title and first line show under them as the cue
that there is more (a focus key scrolls to its panel). A screen adds its own panels to a
row through the ``beside_*`` and ``under_block_table`` slots (the live window
puts the chat beside the map, throughput beside the figures, the system panel
under the block table and the load generator beside the queues).

Drawing is the caller's: ``show`` draws everything; the live window, which
paints under a CPU budget, calls ``show_blocks`` (what moves) and
``show_figures`` (what is read) at different rates. Both take the step's events
and, when the caller has it, the step before's snapshot, which the event line
and the queues' "recently finished" rows read. ``show_empty`` draws a pool no
step has touched yet (a new engine), ``mark_blocks`` points at blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from textual import events
from textual.app import ComposeResult
from textual.widget import Widget

from kvscope.app.messages import AttentionKindShown, BlockHighlighted, RequestSelected
from kvscope.app.widgets.block_inspector import BlockInspector
from kvscope.app.widgets.block_legend import BlockLegend
from kvscope.app.widgets.block_map import BlockMap
from kvscope.app.widgets.block_table import BlockTable
from kvscope.app.widgets.box import Box, titled
from kvscope.app.widgets.counters import Counters
from kvscope.app.widgets.event_line import EventLine
from kvscope.app.widgets.group_kinds import attention_kinds
from kvscope.app.widgets.paged_vs_contiguous import PagedVsContiguous, PoolTotals
from kvscope.app.widgets.queues import QueuesTable
from kvscope.engine.outputs import BLOCK_FREE, CacheSnapshot, EngineEvent, StepStats


def empty_step(num_blocks: int, block_size: int, allocator: str,
               num_host_blocks: int = 0) -> tuple[CacheSnapshot, StepStats]:
    """The snapshot and stats of a pool before its first step: every block free, nothing queued."""
    snapshot = CacheSnapshot(
        step=0, block_size=block_size, num_blocks=num_blocks, allocator=allocator,
        block_state=np.full(num_blocks, BLOCK_FREE, dtype=np.int8), ref_counts=np.zeros(num_blocks, np.int32),
        block_fill=np.zeros(num_blocks, np.int16), block_hashes=np.zeros(num_blocks, np.uint64),
        num_host_blocks=num_host_blocks, num_free_host_blocks=num_host_blocks)
    stats = StepStats(
        step=0, time=0.0, duration=0.0, num_prefill_tokens=0, num_decode_tokens=0, num_running=0,
        num_waiting=0, num_swapped=0, num_free_blocks=num_blocks, num_cached_free_blocks=0,
        num_total_blocks=num_blocks, kv_usage=0.0, kv_token_utilisation=0.0, prefix_cache_queries=0,
        prefix_cache_hits=0, num_preemptions=0, num_swapped_out_blocks=0, num_swapped_in_blocks=0,
        prompt_tokens_per_s=0.0, generation_tokens_per_s=0.0, num_host_blocks=num_host_blocks,
        num_free_host_blocks=num_host_blocks)
    return snapshot, stats


# Rows of the wide layout (kvscope.tcss): the least the top row needs (#top's min-height; a screen whose top
# row holds more asks for more), the figures' row, the bottom row.
TOP_MIN_ROWS = 14
STATS_ROWS = 11
BOTTOM_MIN_ROWS = 11
BOTTOM_ROWS = 16
PEEK_ROWS = 3    # of the bottom row, left on the first screen when it scrolls: its border, title and a line


class SnapshotView(Box):
    """Every panel of one snapshot. Set ``max_model_len`` to what the engine serves (None: unknown)."""

    def __init__(self, *, beside_map: Iterable[Widget] = (), beside_figures: Iterable[Widget] = (),
                 beside_queues: Iterable[Widget] = (), under_block_table: Iterable[Widget] = (),
                 max_model_len: int | None = None, top_min_rows: int = TOP_MIN_ROWS, id: str | None = None) -> None:
        super().__init__(id=id)
        self.max_model_len = max_model_len
        self.top_min_rows = top_min_rows
        self._beside_map = tuple(beside_map)
        self._beside_figures = tuple(beside_figures)
        self._beside_queues = tuple(beside_queues)
        self._under_block_table = tuple(under_block_table)
        # Made here, not looked up: a query walks the DOM, and the live window draws for every step.
        self.block_map = titled(BlockMap(id="block-map", classes="panel"), "Block map")
        self.event_line = EventLine(id="event-line")
        self.inspector = titled(BlockInspector(id="inspector", classes="panel"), "Block")
        self.legend = BlockLegend(id="legend")
        self.counters = titled(Counters(id="counters", classes="panel"), "Counters")
        self.paged = titled(PagedVsContiguous(id="paged", classes="panel"), "Paged vs contiguous")
        self.block_table = titled(BlockTable(id="block-table", classes="panel"), "Block table")
        self.queues = titled(QueuesTable(id="queues", classes="panel"), "Queues")

    def compose(self) -> ComposeResult:
        with Box(id="top", classes="row"):
            with Box(id="map-column"):
                yield self.block_map
                yield self.event_line
                yield self.legend
                yield self.inspector
            yield from self._beside_map
        with Box(id="stats", classes="row"):
            yield self.counters
            yield self.paged
            yield from self._beside_figures
        with Box(id="bottom", classes="row"):
            yield self.queues
            with Box(id="details"):
                yield self.block_table
                yield from self._under_block_table
            yield from self._beside_queues

    # --- fitting the window -------------------------------------------------------------------

    def on_resize(self, event: events.Resize) -> None:
        self.fit_rows()

    def fit_rows(self) -> None:
        """Scroll when the wide layout's three rows cannot all be seen (the narrow one always scrolls)."""
        height = self.size.height
        scrolls = not self.screen.has_class("-narrow") and 0 < height < self.top_min_rows + STATS_ROWS + BOTTOM_MIN_ROWS
        self.set_class(scrolls, "-scrolls")
        top, bottom = self.query_one("#top"), self.query_one("#bottom")
        if scrolls:
            top.styles.height = max(TOP_MIN_ROWS, height - STATS_ROWS - PEEK_ROWS)
            bottom.styles.height = BOTTOM_ROWS
        else:   # back to the style sheet's heights
            top.styles.clear_rule("height")
            bottom.styles.clear_rule("height")

    # --- drawing -------------------------------------------------------------------------------

    def show(self, snapshot: CacheSnapshot, stats: StepStats, events: tuple[EngineEvent, ...] = (),
             previous: CacheSnapshot | None = None) -> None:
        """Draw one step in every panel."""
        self.show_blocks(snapshot)
        self.show_figures(snapshot, stats, events, previous)

    def show_empty(self, num_blocks: int, block_size: int, allocator: str, num_host_blocks: int = 0) -> None:
        """A fresh pool: every block free, before any step; the queues forget the last engine's requests."""
        snapshot, stats = empty_step(num_blocks, block_size, allocator, num_host_blocks)
        self.show_blocks(snapshot)
        self.counters.show_stats(stats)
        self.paged.show_snapshot(snapshot, self._contiguous_row(snapshot))
        self.block_table.show_snapshot(snapshot)
        self.queues.clear()
        self.event_line.show_ready(num_blocks, block_size)

    def show_blocks(self, snapshot: CacheSnapshot) -> None:
        """The map and the block under its cursor: what moves from step to step."""
        self.block_map.show_snapshot(snapshot)
        self.inspector.show_snapshot(snapshot)
        self._show_kinds()

    def show_figures(self, snapshot: CacheSnapshot, stats: StepStats, events: tuple[EngineEvent, ...] = (),
                     previous: CacheSnapshot | None = None) -> None:
        """The panels of numbers and rows: counters, paged vs contiguous, block table, queues, event line."""
        self.counters.show_stats(stats, snapshot.kv_cache_groups)
        totals = self.block_map.pool_totals(snapshot)    # the map's counts, when it drew this snapshot
        self.paged.show_snapshot(snapshot, self._contiguous_row(snapshot),
                                 PoolTotals(*totals) if totals is not None else None)
        self.block_table.show_snapshot(snapshot)
        self.queues.show_snapshot(snapshot, events)
        self.event_line.show_step(stats, events, snapshot, previous)

    def mark_blocks(self, blocks: Iterable[int]) -> None:
        """Point at physical blocks in the map (a lesson's "these ones"); an empty iterable clears."""
        self.block_map.mark_blocks(blocks)

    def _contiguous_row(self, snapshot: CacheSnapshot) -> int:
        """What a contiguous allocator reserves per sequence. Without a known max_model_len (runs
        logged before it was resolved), the longest request seen is a lower bound."""
        if self.max_model_len:
            return self.max_model_len
        longest = max((v.num_prompt_tokens + v.max_tokens for v in snapshot.requests), default=1)
        return max(longest, snapshot.block_size)

    # --- selection, between the panels -----------------------------------------------------------

    def select_request(self, request_id: str | None) -> None:
        """Highlight a request's blocks in the map and show its block table (None: clear)."""
        self.block_map.select_request(request_id)
        self.block_table.select(request_id)

    def on_request_selected(self, message: RequestSelected) -> None:
        message.stop()
        self.select_request(message.request_id)

    def on_attention_kind_shown(self, message: AttentionKindShown) -> None:
        message.stop()
        self._show_kinds()

    def _show_kinds(self) -> None:
        snapshot = self.block_map.snapshot
        kinds = attention_kinds(snapshot.kv_cache_groups) if snapshot is not None else ()
        self.legend.show_kinds(kinds, self.block_map.shown_kind)

    def on_block_highlighted(self, message: BlockHighlighted) -> None:
        message.stop()
        self.inspector.inspect(message.first_block, message.last_block)
