"""SnapshotView: the engine's state at one step, in every panel that draws it, wired together.

The live window, the replay screen (and anything else that shows a snapshot:
a lesson, an attached vLLM server) use this one widget, so a block map, its
legend and inspector, the counters, the paged-vs-contiguous comparison, the
block table and the queues look and behave the same everywhere. Selecting a
request (in the queues or the map) highlights its blocks in the map and the
block table; moving the map's cursor shows that block in the inspector. The
view handles both messages itself and stops them there.

The layout is three rows: the map column on top, the figures under it, the
queues and the block table at the bottom. A screen adds its own panels to a
row through the ``beside_*`` and ``under_block_table`` slots (the live window
puts the chat beside the map, throughput beside the figures, the system panel
under the block table and the load generator beside the queues).

Drawing is the caller's: ``show`` draws everything; the live window, which
paints under a CPU budget, calls ``show_blocks`` (what moves) and
``show_figures`` (what is read) at different rates.
"""

from __future__ import annotations

from collections.abc import Iterable

from textual.app import ComposeResult
from textual.widget import Widget

from kvscope.app.messages import BlockHighlighted, RequestSelected
from kvscope.app.widgets.block_inspector import BlockInspector
from kvscope.app.widgets.block_legend import BlockLegend
from kvscope.app.widgets.block_map import BlockMap
from kvscope.app.widgets.block_table import BlockTable
from kvscope.app.widgets.box import Box, titled
from kvscope.app.widgets.counters import Counters
from kvscope.app.widgets.paged_vs_contiguous import PagedVsContiguous
from kvscope.app.widgets.queues import QueuesTable
from kvscope.engine.outputs import CacheSnapshot, StepStats


class SnapshotView(Box):
    """Every panel of one snapshot. Set ``max_model_len`` to what the engine serves (None: unknown)."""

    def __init__(self, *, beside_map: Iterable[Widget] = (), beside_figures: Iterable[Widget] = (),
                 beside_queues: Iterable[Widget] = (), under_block_table: Iterable[Widget] = (),
                 max_model_len: int | None = None, id: str | None = None) -> None:
        super().__init__(id=id)
        self.max_model_len = max_model_len
        self._beside_map = tuple(beside_map)
        self._beside_figures = tuple(beside_figures)
        self._beside_queues = tuple(beside_queues)
        self._under_block_table = tuple(under_block_table)
        # Made here, not looked up: a query walks the DOM, and the live window draws for every step.
        self.block_map = titled(BlockMap(id="block-map", classes="panel"), "Block map")
        self.inspector = titled(BlockInspector(id="inspector", classes="panel"), "Block")
        self.counters = titled(Counters(id="counters", classes="panel"), "Counters")
        self.paged = titled(PagedVsContiguous(id="paged", classes="panel"), "Paged vs contiguous")
        self.block_table = titled(BlockTable(id="block-table", classes="panel"), "Block table")
        self.queues = titled(QueuesTable(id="queues", classes="panel"), "Queues")

    def compose(self) -> ComposeResult:
        with Box(id="top", classes="row"):
            with Box(id="map-column"):
                yield self.block_map
                yield BlockLegend(id="legend")
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

    # --- drawing -------------------------------------------------------------------------------

    def show(self, snapshot: CacheSnapshot, stats: StepStats) -> None:
        """Draw one step in every panel."""
        self.show_blocks(snapshot)
        self.show_figures(snapshot, stats)

    def show_blocks(self, snapshot: CacheSnapshot) -> None:
        """The map and the block under its cursor: what moves from step to step."""
        self.block_map.show_snapshot(snapshot)
        self.inspector.show_snapshot(snapshot)

    def show_figures(self, snapshot: CacheSnapshot, stats: StepStats) -> None:
        """The panels of numbers and rows: counters, paged vs contiguous, block table, queues."""
        self.counters.show_stats(stats)
        self.paged.show_snapshot(snapshot, self._contiguous_row(snapshot))
        self.block_table.show_snapshot(snapshot)
        self.queues.show_snapshot(snapshot)

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

    def on_block_highlighted(self, message: BlockHighlighted) -> None:
        message.stop()
        self.inspector.inspect(message.first_block, message.last_block)
