"""The live view: every panel, fed with each engine step, painted at most FRAME_RATE times a second.

``ingest`` runs for every step and only does what must not be skipped
(streaming chat text, the throughput history). ``paint`` draws the newest
snapshot as a batch of steps arrives (the engine thread posts at most ten
batches a second: app/worker/step_posting.py); snapshots that arrive
between two frames are never drawn. Every wake of the UI's loop takes the GIL from the engine thread,
so no timer of its own runs at the frame rate: a slow one (IDLE_TICK_RATE)
draws what is still due once the steps stop coming (the numbers, a frame the
budget held back) and the system figures.

The UI shares the CPU (and the GIL) with the engine thread, so painting is
governed by the UI thread's own CPU time: a frame is skipped while the thread
has used more than UI_CPU_BUDGET of a core since the last one. Cheap frames
come at FRAME_RATE; costly ones (a big pool, hundreds of rows) come less often,
but never less than MIN_FRAME_RATE.

The block map (and the block under the cursor) is what moves; the panels of
numbers (counters, paged vs contiguous, throughput, queues, block table) are
read, and cost most of a frame to rebuild: they are drawn at most TEXT_RATE
times a second. Every Textual repaint pass also costs a few milliseconds
whatever it draws, so the slower panels and the system figures are drawn in the
same pass as a new snapshot's map, not on ticks of their own, unless the steps
have stopped coming.
"""

from __future__ import annotations

import gc
import time

from textual import events
from textual.app import ComposeResult
from textual.screen import Screen

from kvscope.app.actions import FOOTER_RANKS
from kvscope.app.messages import EngineInfo, RunState
from kvscope.app.widgets.box import titled
from kvscope.app.widgets.chat import DEFAULT_MAX_TOKENS, ChatPane
from kvscope.app.widgets.chat_input import ChatInput
from kvscope.app.widgets.event_line import readable_previous
from kvscope.app.widgets.header import EngineHeader
from kvscope.app.widgets.key_bar import KeyBar
from kvscope.app.widgets.load_generator import LoadGenerator
from kvscope.app.widgets.snapshot_view import SnapshotView
from kvscope.app.widgets.status_line import VllmStatusLine
from kvscope.app.widgets.system import REFRESH_S as SYSTEM_REFRESH_S
from kvscope.app.widgets.system import SystemPanel, SystemSampler
from kvscope.app.widgets.throughput import Throughput
from kvscope.engine.outputs import CacheSnapshot, StepResult, StepStats

FRAME_RATE = 20
UI_CPU_BUDGET = 0.04  # share of one core the UI thread may use for painting and handling steps
MIN_FRAME_RATE = 1    # however busy the UI thread is, the view is at most this stale
TEXT_RATE = 4         # the panels of numbers: as often as a person can read them
IDLE_TICK_RATE = TEXT_RATE    # the paint timer's: frames the steps' own wakes did not draw are at most this late
# The map, its event line, legend and block inspector, and the chat beside them, all readable: under this plus
# the figures and the queues (120x40), the view scrolls and the queues' title shows at the bottom as the cue.
TOP_MIN_ROWS = 16
SETTLE_FRAMES = 3


class MainScreen(Screen):
    AUTO_FOCUS = "#chat-input"
    BLANK = True   # only its background shows, between the panels: no styles pass for it (see Box)

    def __init__(self, *, system_sampler: SystemSampler | None = None,
                 chat_max_tokens: int = DEFAULT_MAX_TOKENS,
                 chat_sampling: tuple[tuple[str, float | int], ...] = ()) -> None:
        super().__init__(id="main")
        self.engine_info: EngineInfo | None = None
        self.latest: StepResult | None = None
        self.previous: StepResult | None = None   # the step before latest, for the event line
        self.queued: CacheSnapshot | None = None   # the newest snapshot: of a step, or of requests added paused
        self._painted: StepResult | None = None
        self._texted: StepResult | None = None   # the step the panels of numbers show
        self._painted_at = 0.0
        self._texted_at = 0.0
        self._busy_text_frames = 0    # text frames of an engine with requests, until its window has settled
        self._last_frame = (time.monotonic(), time.thread_time())
        self.header = EngineHeader(id="header")
        self.chat = titled(ChatPane(max_tokens=chat_max_tokens, sampling=chat_sampling, id="chat",
                                   classes="panel"), "Chat")
        self.throughput = titled(Throughput(id="throughput", classes="panel"), "Throughput")
        self.system = titled(SystemPanel(system_sampler, id="system", classes="panel"), "System")
        # The status line runs under the panels in a wide window, and inside the scrolling column in a
        # narrow one, where three wrapped lines at the bottom would cost an eighth of the screen.
        wide = VllmStatusLine(id="vllm-status", classes="wide-only")
        self.status_lines = (wide, titled(VllmStatusLine(id="vllm-status-narrow", classes="panel narrow-only",
                                                         window=wide.window),
                                    "vLLM-style status"))
        self.view = SnapshotView(
            id="body", beside_map=[self.chat], beside_figures=[self.throughput, self.status_lines[1]],
            under_block_table=[self.system],
            beside_queues=[titled(LoadGenerator(id="load", classes="panel"), "Load generator")],
            top_min_rows=TOP_MIN_ROWS)

    def compose(self) -> ComposeResult:
        yield self.header
        yield self.view
        yield self.status_lines[0]
        yield KeyBar(keep_first=FOOTER_RANKS, id="keys")

    def on_mount(self) -> None:
        self.set_interval(1 / IDLE_TICK_RATE, self.paint)

    def on_paste(self, event: events.Paste) -> None:
        """A paste that reached no input (the focus on the map, after Esc) goes to the chat, not nowhere."""
        event.stop()
        chat_input = self.query_one("#chat-input", ChatInput)
        chat_input.focus()
        chat_input.post_message(events.Paste(event.text))

    # --- fed by the app ---------------------------------------------------------------------

    def show_starting(self, model: str) -> None:
        self.header.show_starting(model)
        self.chat.set_engine_waiting(True)

    def engine_ready(self, info: EngineInfo) -> None:
        """A new engine: its empty pool in every panel at once, nothing of any engine before it."""
        self.engine_info = info
        self.view.max_model_len = info.runner.max_model_len
        self.latest = self.previous = self._painted = self._texted = self.queued = None
        self.header.show_engine(info)
        self.throughput.clear()
        for line in self.status_lines:
            line.reset(info.runner.device)
        self.view.show_empty(info.runner.num_device_blocks, info.runner.block_size, info.config.allocator,
                             info.runner.num_host_blocks)
        self.chat.set_engine_waiting(False)
        self.chat.show_sampling(info.runner.sampling_defaults)
        # The window's own objects (every widget, style and cached line) and the new engine's live for the whole
        # run: out of the collector's reach, a full collection, which the steps' garbage sets off every few
        # seconds, walks only what came since instead of holding the GIL over the whole window. The engine this
        # one replaced is collected first, so that none of its cycles stays frozen.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self._busy_text_frames = 0

    def engine_not_ready(self, still_running: EngineInfo | None, error: str) -> None:
        """A build failed: back to the engine that goes on serving, or say there is none."""
        header = self.header
        if still_running is not None:
            header.show_engine(still_running)
        else:
            header.show_stopped(error)
        self.chat.set_engine_waiting(still_running is None and self.engine_info is None)

    def show_serving(self, url: str) -> None:
        """kvscope --serve: the API's address stays in the header, where no toast can hide or time it out."""
        self.header.show_serving(url)

    def engine_died(self, error: str) -> None:
        self.header.show_stopped(error)

    def show_state(self, state: RunState) -> None:
        self.header.show_state(state)

    # --- the chat, for the app: one call each, so the app never reaches into the panels ---------------

    def chat_sent(self, request_id: str) -> None:
        """The chat's turn went to the engine: the map follows its blocks."""
        self.view.block_map.set_chat_request(request_id)

    def chat_refused(self, request_id: str, error: str) -> None:
        self.chat.show_rejection(request_id, error)

    @property
    def reply_streaming(self) -> bool:
        return self.chat.current_request is not None

    def abort_chat(self) -> str | None:
        """Stop showing the chat's reply in flight and return its id for the engine to abort (None: none)."""
        request_id = self.chat.abort()
        if request_id is not None:
            self.view.block_map.set_chat_request(None)
        return request_id

    def action_leave_chat(self) -> None:
        """Esc in the chat: the focus leaves the input for the map, whether or not a reply streams."""
        self.view.block_map.focus()

    def new_conversation(self) -> str | None:
        """Forget every turn; returns the reply in flight, if any, for the engine to abort."""
        request_id = self.chat.new_conversation()
        if request_id is not None:
            self.view.block_map.set_chat_request(None)
        return request_id

    def requests_in_flight(self) -> tuple[str, ...]:
        """The requests of the newest snapshot (a step's, or one taken when requests were added paused), and the
        chat's turn when it has not reached a step yet."""
        ids = tuple(view.request_id for view in self.queued.requests) if self.queued else ()
        pending = self.chat.current_request
        return ids if pending is None or pending in ids else (*ids, pending)

    def ingest(self, result: StepResult) -> None:
        chat = self.chat
        reply = chat.current_request
        if reply is not None:     # the chat shows its own reply only: no call per request of a big batch
            for output in result.outputs:
                if output.request_id == reply:
                    chat.show_output(output)
        block_map = self.view.block_map
        block_map.note_step(result.snapshot)    # the next frame applies every step's block changes
        if chat.current_request is None and block_map.chat_request is not None:
            block_map.set_chat_request(None)
        self.throughput.push(result.stats)
        self.view.queues.note_step(result.events, result.outputs)
        self.status_lines[0].push(result.stats)     # the two share their window of rates
        self.previous, self.latest = self.latest, result
        self.queued = result.snapshot

    def show_queue(self, snapshot: CacheSnapshot) -> None:
        """Requests launched while the engine is paused: in "waiting" now, not at the next step."""
        self.queued = snapshot
        self.view.queues.show_snapshot(snapshot)
        if self.latest is not None:
            self._show_status(snapshot, self.latest.stats)

    def _show_status(self, snapshot: CacheSnapshot, stats: StepStats) -> None:
        """Both status lines (one shows, by the window's width): one sentence, worked out once."""
        text = self.status_lines[0].status_text(snapshot, stats)
        for line in self.status_lines:
            line.show(text)

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
        """Draw the newest step, and whatever else is due, in one repaint pass."""
        if not force and not self.is_current:
            return    # a lesson or the history is on top: nobody sees this screen
        now = time.monotonic()
        result = self.latest
        fresh = result is not None and result is not self._painted
        self.system.refresh_if_due(now, SYSTEM_REFRESH_S if fresh else 2 * SYSTEM_REFRESH_S)
        if result is None:
            return
        stale = result is not self._texted
        text_due = stale and (force or now - self._texted_at >= 1 / TEXT_RATE and (
            fresh or now - self._painted_at >= 1 / TEXT_RATE))
        if not (fresh or text_due):
            return
        if not force and not self._within_budget():
            return
        if fresh:
            self._painted, self._painted_at = result, now
            self.view.show_blocks(result.snapshot)
        if text_due:
            self._texted, self._texted_at = result, now
            self._settle(result.snapshot)
            self.view.show_figures(result.snapshot, result.stats, result.events, readable_previous(self.previous))
            self._show_status(result.snapshot, result.stats)
            self.throughput.redraw()

    def _settle(self, snapshot: CacheSnapshot) -> None:
        """The first frames of a busy engine fill every panel, and the objects they make (cached lines and
        strips, rows, layout) live as long as the window: once SETTLE_FRAMES text frames of requests are drawn,
        they join the frozen ones (engine_ready), out of the full collections the engine thread sets off, each
        of which walked them all again. Once per engine, so anything frozen that later becomes cyclic garbage
        is bounded by what lived at that moment, and is collected with the next engine."""
        if self._busy_text_frames >= SETTLE_FRAMES or not snapshot.requests:
            return
        self._busy_text_frames += 1
        if self._busy_text_frames == SETTLE_FRAMES:
            gc.collect()
            gc.freeze()
