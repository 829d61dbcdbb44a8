"""The live view: every panel, fed with each engine step, painted at most FRAME_RATE times a second.

``ingest`` runs for every step and only does what must not be skipped
(streaming chat text, the throughput history). ``paint`` draws the newest
snapshot on a timer; snapshots that arrive between two frames are never drawn.

The UI shares the CPU (and the GIL) with the engine thread, so painting is
governed by the UI thread's own CPU time: a frame is skipped while the thread
has used more than UI_CPU_BUDGET of a core since the last one. Cheap frames
come at FRAME_RATE; costly ones (a big pool, hundreds of rows) come less often,
but never less than MIN_FRAME_RATE.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from app.messages import BlockHighlighted, EngineInfo, RequestSelected, RunState
from app.widgets.block_inspector import BlockInspector
from app.widgets.block_legend import BlockLegend
from app.widgets.block_map import BlockMap
from app.widgets.block_table import BlockTable
from app.widgets.chat import DEFAULT_MAX_TOKENS, ChatPane
from app.widgets.counters import Counters
from app.widgets.header import EngineHeader
from app.widgets.load_generator import LoadGenerator
from app.widgets.paged_vs_contiguous import PagedVsContiguous
from app.widgets.queues import QueuesTable
from app.widgets.system import SystemPanel, SystemSampler
from app.widgets.throughput import Throughput
from engine.outputs import StepResult

FRAME_RATE = 20
UI_CPU_BUDGET = 0.10  # share of one core the UI thread may use for painting and handling steps
MIN_FRAME_RATE = 1    # however busy the UI thread is, the view is at most this stale
QUEUE_RATE = 5  # a DataTable re-renders every visible cell on any change: keep it to a few times a second


def titled(widget, title: str):
    widget.border_title = title
    return widget


class MainScreen(Screen):
    AUTO_FOCUS = "#chat-input"

    def __init__(self, *, system_sampler: SystemSampler | None = None,
                 chat_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        super().__init__(id="main")
        self._system_sampler = system_sampler
        self._chat_max_tokens = chat_max_tokens
        self.engine_info: EngineInfo | None = None
        self.latest: StepResult | None = None
        self._painted: StepResult | None = None
        self._queued: StepResult | None = None
        self._queues_painted_at = 0.0
        self._last_frame = (time.monotonic(), time.thread_time())

    def compose(self) -> ComposeResult:
        yield EngineHeader(id="header")
        with Vertical(id="body"):
            with Horizontal(id="top"):
                with Vertical(id="map-column"):
                    yield titled(BlockMap(id="block-map", classes="panel"), "Block map")
                    yield BlockLegend(id="legend")
                    yield titled(BlockInspector(id="inspector", classes="panel"), "Block")
                yield titled(ChatPane(max_tokens=self._chat_max_tokens, id="chat", classes="panel"), "Chat")
            with Horizontal(id="stats"):
                yield titled(Counters(id="counters", classes="panel"), "Counters")
                yield titled(PagedVsContiguous(id="paged", classes="panel"), "Paged vs contiguous")
                yield titled(Throughput(id="throughput", classes="panel"), "Throughput")
            with Horizontal(id="bottom"):
                yield titled(QueuesTable(id="queues", classes="panel"), "Queues")
                with Vertical(id="details"):
                    yield titled(BlockTable(id="block-table", classes="panel"), "Block table")
                    yield titled(SystemPanel(self._system_sampler, id="system", classes="panel"), "System")
                yield titled(LoadGenerator(id="load", classes="panel"), "Load generator")
        yield Footer()

    def on_mount(self) -> None:
        # Looked up once: ingest runs for every engine step.
        self.chat = self.query_one(ChatPane)
        self.block_map = self.query_one(BlockMap)
        self.throughput = self.query_one(Throughput)
        self.set_interval(1 / FRAME_RATE, self.paint)

    # --- fed by the app ---------------------------------------------------------------------

    def show_starting(self, model: str) -> None:
        self.query_one(EngineHeader).show_starting(model)

    def engine_ready(self, info: EngineInfo) -> None:
        self.engine_info = info
        self.latest = self._painted = self._queued = None
        self.query_one(EngineHeader).show_engine(info)
        self.query_one(Throughput).clear()
        self.query_one(ChatPane).interrupt("the engine was restarted; ask again")

    def show_state(self, state: RunState) -> None:
        self.query_one(EngineHeader).show_state(state)

    def ingest(self, result: StepResult) -> None:
        chat = self.chat
        for output in result.outputs:
            chat.on_output(output)
        if chat.current_request is None and self.block_map.chat_request is not None:
            self.block_map.set_chat_request(None)
        self.throughput.push(result.stats)
        self.latest = result

    def _within_budget(self) -> bool:
        """Whether the UI thread (the caller) kept under its CPU budget since the last frame."""
        wall, cpu = time.monotonic(), time.thread_time()
        last_wall, last_cpu = self._last_frame
        starved = wall - last_wall >= 1 / MIN_FRAME_RATE
        if cpu - last_cpu > UI_CPU_BUDGET * (wall - last_wall) and not starved:
            return False
        self._last_frame = (wall, cpu)
        return True

    def paint(self, force: bool = False) -> None:
        """Draw the newest step. The queue table, the costliest panel, redraws at most QUEUE_RATE a second."""
        result = self.latest
        if result is None or (result is self._painted and self._queued is result):
            return
        if not force and not self._within_budget():
            return
        if result is not self._painted:
            self._painted = result
            snapshot = result.snapshot
            self.block_map.show_snapshot(snapshot)
            self.query_one(BlockInspector).show_snapshot(snapshot)
            self.query_one(BlockTable).show_snapshot(snapshot)
            self.query_one(Counters).show_stats(result.stats)
            if self.engine_info is not None:
                self.query_one(PagedVsContiguous).show_snapshot(snapshot, self.engine_info.max_model_len)
            self.throughput.redraw()
        now = time.monotonic()
        if self._queued is not result and (force or now - self._queues_painted_at >= 1 / QUEUE_RATE):
            self._queued, self._queues_painted_at = result, now
            self.query_one(QueuesTable).show_snapshot(result.snapshot)

    # --- between the panels -------------------------------------------------------------------

    def on_request_selected(self, message: RequestSelected) -> None:
        message.stop()
        self.query_one(BlockMap).select_request(message.request_id)
        self.query_one(BlockTable).select(message.request_id)

    def on_block_highlighted(self, message: BlockHighlighted) -> None:
        message.stop()
        self.query_one(BlockInspector).inspect(message.first_block, message.last_block)
