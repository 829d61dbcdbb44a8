"""Replay a logged run step by step in the live window's own snapshot view (app/widgets/snapshot_view.py).

Frames are decoded on demand: moving forward one step reads the next frame of an
open stream (one delta); any other move asks the reader for that step, which
decodes from the keyframe before it. A step that cannot be read (a damaged
blob or page) is reported in the status line; the screen stays on the last good
frame and the other steps can still be shown.

The queues' "recently finished" rows are what the live window showed at that
step: a jump (End, a step number) first runs the queues through the steps a
finished row stays for, and every finished row takes its last numbers and
finish reason from the run log's requests table.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.content import Content
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Input, Static

from kvscope.app.runlog import ReplayFrame, RunLogReader
from kvscope.app.safe_text import escape, one_line
from kvscope.app.widgets.key_bar import KeyBar
from kvscope.app.widgets.queue_rows import FINISHED_KEEP_STEPS
from kvscope.app.widgets.snapshot_view import SnapshotView
from kvscope.engine.outputs import CacheSnapshot, EngineEvent, StepStats

SPEEDS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)  # steps per second
DEFAULT_SPEED = 3


@runtime_checkable
class StepView(Protocol):
    """What a ReplayScreen draws each step with, a widget: the live window's SnapshotView, or the attached
    window's VllmReplayView for a run kvscope watched instead of ran."""

    @property
    def block_map(self) -> Widget:
        """The map, which gets the keys back after a jump so the replay's controls work again."""
        ...

    def show(self, snapshot: CacheSnapshot, stats: StepStats, events: tuple[EngineEvent, ...] = (),
             previous: CacheSnapshot | None = None) -> None:
        """Draw one step; ``events`` and ``previous`` (the step before) are for views that tell what changed."""
        ...


def describe_events(frame: ReplayFrame) -> str:
    if not frame.events:
        return ""
    # Kinds and request ids as the run log holds them: whoever wrote the file chose them.
    shown = [escape(one_line(f"{e.kind} {e.request_id or ''}", 60)) for e in frame.events[:4]]
    more = f" +{len(frame.events) - 4}" if len(frame.events) > 4 else ""
    return " · events: " + ", ".join(shown) + more


class ReplayScreen(Screen):
    BINDINGS = [
        Binding("left,p", "step(-1)", "Prev", priority=True),
        Binding("right,n", "step(1)", "Next", priority=True),
        Binding("pageup", "step(-10)", "-10", show=False),
        Binding("pagedown", "step(10)", "+10", show=False),
        Binding("home", "jump_to_index(0)", "First", show=False),
        Binding("end", "jump_to_index(-1)", "Last", show=False),
        Binding("space", "toggle_play", "Play/Pause", priority=True),
        Binding("minus", "speed(-1)", "Slower"),
        Binding("plus,equals_sign", "speed(1)", "Faster"),
        Binding("g", "focus_jump", "Jump to step"),
        Binding("escape", "app.pop_screen", "Back"),
    ]

    def __init__(self, reader: RunLogReader, run_id: int) -> None:
        super().__init__(id="replay")
        self.reader = reader
        self.run_id = run_id
        self.run = reader.run(run_id)
        self.steps = reader.recorded_steps(run_id)
        self.index = 0
        self.frame: ReplayFrame | None = None
        self.speed_index = DEFAULT_SPEED
        self._timer: Timer | None = None
        self._stream: Iterator[ReplayFrame] | None = None
        self._stream_index = -1
        config = self.run.get("config") or {}
        self.view: StepView = SnapshotView(id="body", max_model_len=config.get("max_model_len"))

    def compose(self) -> ComposeResult:
        # The jump box shares the status's one row: below the view it took three rows from the queues, and a
        # status that wrapped to two rows shrank the map (its scale flipped between 5 and 6 blocks a cell).
        with Horizontal(id="replay-top"):
            yield Static("", id="replay-status")
            yield Input(placeholder="g: jump to step", type="integer", id="jump", compact=True)
        yield self.view
        yield KeyBar(own_only=True, id="keys")

    def on_mount(self) -> None:
        self.view.block_map.focus()     # the replay's keys, not the jump box, which comes first on the screen
        if self._queues is not None:
            self._queues.note_logged_finals(self.reader.final_figures(self.run_id))
        if self.steps:
            self.show_index(0)
        else:
            self.query_one("#replay-status", Static).update(f"Run {self.run_id} has no recorded steps.")

    @property
    def playing(self) -> bool:
        return self._timer is not None

    # --- frames --------------------------------------------------------------------------------

    def _frame_at(self, index: int) -> ReplayFrame:
        if self._stream is not None and index == self._stream_index + 1:
            frame = next(self._stream, None)
            if frame is not None and frame.stats.step == self.steps[index]:
                self._stream_index = index
                return frame
        if index == 0:
            self._stream = self.reader.iter_snapshots(self.run_id)
            self._stream_index = 0
            return next(self._stream)
        self._stream = None
        return self.reader.snapshot_at(self.run_id, self.steps[index])

    def show_index(self, index: int) -> None:
        if not self.steps:
            return
        index = min(max(index, 0), len(self.steps) - 1)
        try:
            frame = self._frame_at(index)
        except Exception as exc:    # whatever a damaged file makes the reader raise must not end the app
            self._stream = None
            self._stop_timer()
            self._say(f"[b]Replay[/b] · run {self.run_id} · cannot show step {self.steps[index]:,}: "
                      f"$error", error=f"{type(exc).__name__}: {exc}")
            return
        if self.frame is not None and index != self.index + 1 and self._queues is not None:
            self._catch_up_queues(index)
        previous, self.index, self.frame = self.frame, index, frame
        # The event line narrates the logged step; the step before (when it is the one shown last) lets
        # it count prefill chunks and admissions, as the live window does.
        self.view.show(frame.snapshot, frame.stats, frame.events, previous.snapshot if previous else None)
        self._update_status()

    @property
    def _queues(self):
        """The view's queue table (an attached server's replay has none: vLLM publishes no requests)."""
        return getattr(self.view, "queues", None)

    def _catch_up_queues(self, index: int) -> None:
        """Show the queues the steps before ``index`` that a finished row stays for, as the live window saw them
        one by one (only the queues: nothing else keeps history)."""
        queues, target = self._queues, self.steps[index]
        queues.clear()
        if index == 0:
            return
        first = self.steps[max(0, bisect.bisect_left(self.steps, target - FINISHED_KEEP_STEPS))]
        try:
            for frame in self.reader.frames(self.run_id, first, self.steps[index - 1]):
                queues.show_snapshot(frame.snapshot, frame.events)
        except Exception:   # a damaged step: the rows start from the target step, as before
            queues.clear()

    def _say(self, markup: str, **variables: str) -> None:
        cleaned = {name: one_line(value, 200) for name, value in variables.items()}
        self.query_one("#replay-status", Static).update(Content.from_markup(markup, **cleaned))

    def _update_status(self) -> None:
        state = f"▶ playing at {SPEEDS[self.speed_index]:g} steps/s" if self.playing else "■ paused"
        events = describe_events(self.frame) if self.frame else ""
        text = (f"[b]Replay[/b] · run {self.run_id} · $model · step {self.steps[self.index]:,} "
                f"({self.index + 1:,} of {len(self.steps):,} recorded) · {state}{events}")
        self._say(text, model=str(self.run.get("model") or ""))

    # --- controls ---------------------------------------------------------------------------------

    def action_step(self, delta: int) -> None:
        self.show_index(self.index + delta)

    def action_jump_to_index(self, index: int) -> None:
        self.show_index(index if index >= 0 else len(self.steps) + index)

    def jump_to_step(self, step: int) -> None:
        """Show ``step``, or the last recorded step before it."""
        self.show_index(max(bisect.bisect_right(self.steps, step) - 1, 0))

    def action_toggle_play(self) -> None:
        if self.playing:
            self._stop_timer()
        else:
            if self.index == len(self.steps) - 1:
                self.show_index(0)
            self._start_timer()
        self._update_status()

    def action_speed(self, delta: int) -> None:
        self.speed_index = min(max(self.speed_index + delta, 0), len(SPEEDS) - 1)
        if self.playing:
            self._stop_timer()
            self._start_timer()
        self._update_status()

    def _start_timer(self) -> None:
        self._timer = self.set_interval(1 / SPEEDS[self.speed_index], self._advance)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer = None

    def _advance(self) -> None:
        if self.index >= len(self.steps) - 1:
            self._stop_timer()
            self._update_status()
            return
        self.show_index(self.index + 1)

    def action_focus_jump(self) -> None:
        self.query_one("#jump", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip().isdigit():
            self.jump_to_step(int(event.value))
        event.input.value = ""
        self.view.block_map.focus()  # hand the keys back to the replay controls
