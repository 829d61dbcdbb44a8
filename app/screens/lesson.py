"""The lesson screen: the live snapshot view, the lesson's words beside the map, Space and Backspace.

The engine thread is the app's own; the screen hands the lesson's commands to
it through a LessonRunner and shows what comes back. A beat reached live is
drawn from the very step it stopped at; a beat gone back to is drawn from the
run log (the step as it was logged), with the caption it had.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Static

from kvscope.app.lessons.runner import BeatRecord, LessonRunner
from kvscope.app.lessons.script import Beat, Lesson
from kvscope.app.messages import EngineInfo
from kvscope.app.runlog import RunLogReader, RunNotFound
from kvscope.app.widgets.box import titled
from kvscope.app.widgets.key_bar import KeyBar
from kvscope.app.widgets.lesson_panel import LessonPanel
from kvscope.app.widgets.snapshot_view import SnapshotView
from kvscope.app.widgets.status_line import VllmStatusLine
from kvscope.engine.config import EngineConfig
from kvscope.engine.outputs import StepResult

FRAME_S = 1 / 8           # live frames while the engine runs to the next beat (a CPU step takes longer)
LOG_RETRY_S = 0.1         # the run log's writer flushes at least this often


class LessonScreen(Screen):
    AUTO_FOCUS = "#lesson-panel"   # arrows scroll the words; M moves to the map
    BINDINGS = [
        Binding("space", "forward", "Next", priority=True),
        Binding("backspace", "back", "Back", priority=True),
        Binding("escape", "leave", "Leave lesson"),
        Binding("q", "app.quit", "Quit"),
    ]

    def __init__(self, lesson: Lesson, config: EngineConfig) -> None:
        super().__init__()
        self.lesson = lesson
        self.config = config
        self.panel = titled(LessonPanel(id="lesson-panel", classes="panel"), "Lesson")
        self.view = SnapshotView(id="body", beside_map=[self.panel])
        self.status_line = VllmStatusLine(id="vllm-status")
        # Held, not queried: a beat's title may be set while the screen is not composed yet or already gone.
        self.title_line = Static("", id="lesson-title")
        self.runner: LessonRunner | None = None
        self.latest: StepResult | None = None
        self.previous: StepResult | None = None
        self._painted: StepResult | None = None
        self._painted_at = 0.0
        self._reader: RunLogReader | None = None

    def compose(self) -> ComposeResult:
        yield self.title_line
        yield self.view
        yield self.status_line
        yield KeyBar(own_only=True, id="keys")

    def on_mount(self) -> None:
        app = self.app
        self.runner = LessonRunner(self.lesson, self.config, app.worker.send, self,
                                   run_id=lambda: app.run_id)
        self.set_interval(FRAME_S, self._paint_latest)
        self.runner.start()

    def on_unmount(self) -> None:
        if self._reader is not None:
            self._reader.close()

    # --- fed by the app ----------------------------------------------------------------------------

    def engine_ready(self, info: EngineInfo) -> None:
        self.view.max_model_len = info.runner.max_model_len
        self.latest = self.previous = self._painted = None
        self.status_line.reset(info.runner.device)
        self.view.show_empty(info.runner.num_device_blocks, info.runner.block_size, info.config.allocator,
                             info.runner.num_host_blocks)
        self.runner.engine_ready(info)

    def ingest(self, result: StepResult) -> None:
        self.previous, self.latest = self.latest, result
        self.status_line.push(result.stats)
        # Every step reaches the queues, not only the painted ones: a lesson has a handful of requests, and
        # its finished rows then keep each request's last numbers whatever the frame timing was.
        self.view.queues.note_step((), result.outputs)
        self.view.queues.show_snapshot(result.snapshot, result.events)
        self.runner.stepped(result)

    def until_done(self, step: int, met: bool) -> None:
        self.runner.until_done(step, met)

    # --- LessonDisplay ----------------------------------------------------------------------------

    def show_running(self, index: int, beat: Beat) -> None:
        self.panel.show_running(index + 1, len(self.lesson.beats), beat.title)
        self._title(index, "▶ running")

    def show_live(self, record: BeatRecord, result: StepResult) -> None:
        previous = self.previous.snapshot if self.previous is not None and result is self.latest else None
        self._draw(result, previous)
        self._point(record)
        note = "" if record.met else "(the engine ran out of work or steps before this moment: numbers as they are)"
        self.panel.show_beat(record.index + 1, len(self.lesson.beats), record.title, record.caption, note)
        self._title(record.index, "■ paused here")

    def show_past(self, record: BeatRecord) -> None:
        frame = self._logged_frame(record)
        if frame is None:     # not flushed yet: look again, unless the user has moved on meanwhile
            self.set_timer(LOG_RETRY_S, lambda: self.runner.showing == record.index and self.show_past(record))
            return
        self.view.show(frame.snapshot, frame.stats, frame.events)
        self._point(record)
        self.panel.show_beat(record.index + 1, len(self.lesson.beats), record.title, record.caption,
                             f"replayed from the run log: run {record.run_id}, step {record.step}")
        self._title(record.index, "◀ replayed")

    # --- drawing -----------------------------------------------------------------------------------

    def _draw(self, result: StepResult, previous=None) -> None:
        self.view.show(result.snapshot, result.stats, result.events, previous)
        self.status_line.show_status(result.snapshot, result.stats)
        self._painted, self._painted_at = result, time.monotonic()

    def _paint_latest(self) -> None:
        """Live frames while running to a beat; a shown beat stays as it is."""
        result = self.latest
        if self.runner.running is None or result is None or result is self._painted:
            return
        self._draw(result, self.previous.snapshot if self.previous is not None else None)

    def _point(self, record: BeatRecord) -> None:
        self.view.select_request(record.highlight.request_id)
        self.view.mark_blocks(record.highlight.blocks)

    def _title(self, index: int, state: str) -> None:
        self.title_line.update(
            f"[b $accent]kvscope lesson[/] · [b]{self.lesson.title}[/b] · beat {index + 1} of "
            f"{len(self.lesson.beats)} · {state}")

    def _logged_frame(self, record: BeatRecord):
        """The beat's step from the run log; None while the writer has not flushed it yet."""
        if record.run_id is None or self.app.db_path is None:
            return None
        if self._reader is None:
            try:
                self._reader = RunLogReader(self.app.db_path)
            except FileNotFoundError:
                return None
        steps = self._reader.recorded_steps(record.run_id)
        if not steps or steps[-1] < record.step:
            return None
        try:
            return self._reader.snapshot_at(record.run_id, record.step)
        except RunNotFound:
            return None

    # --- keys --------------------------------------------------------------------------------------

    def action_forward(self) -> None:
        if self.runner.running is not None:
            self.notify("The engine is still running to this beat.", timeout=2)
        elif not self.runner.forward():
            self.notify("End of the lesson: Backspace goes back, Esc returns to kvscope.", timeout=4)

    def action_back(self) -> None:
        earlier = self.runner.showing - 1
        if self.runner.running is None and 0 <= earlier < len(self.runner.records) \
                and self.runner.records[earlier].run_id is None:
            # The beat was never logged (the run log could not be opened): going back would wait for ever.
            why = self.app.run_log_warning or "the run log is off"
            self.notify(f"Backspace replays earlier beats from the run log, and this lesson has none: {why}.",
                        title="Cannot go back", severity="warning", timeout=10)
            return
        if not self.runner.back() and self.runner.running is None:
            self.notify("This is the first beat.", timeout=2)

    def action_leave(self) -> None:
        self.app.leave_lesson()
