"""LessonRunner: walks a lesson's beats on the app's engine thread, forward live and backward from the run log.

Forward (Space), the next beat's commands go to the engine thread (rebuild,
requests, run until its moment), and the beat is shown once the thread says it
stopped there. A beat that builds a new engine first lets the old one finish its
requests, unseen, so every run of a lesson ends whole (its figures count every
step, and the run log has no request aborted by the lesson itself).

Backward (Backspace) never rewinds the engine: the earlier beat's step is read
back from the run log (each engine the lesson builds is one logged run) and
shown with the caption it had, and Space walks forward through the replayed
beats until it reaches the live one again.

The runner holds no widget: it sends worker commands through ``send`` and
tells a ``display`` what to show (see LessonDisplay), so it can be driven and
tested without a screen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from kvscope.app.lessons.cues import all_done
from kvscope.app.lessons.script import Beat, Highlight, Lesson, Moment, StepRecord
from kvscope.app.messages import EngineInfo
from kvscope.app.worker.commands import LaunchPlan, Rebuild, RunUntil, SetPaused, WorkerCommand
from kvscope.engine.config import EngineConfig
from kvscope.engine.outputs import StepResult


@dataclass(frozen=True)
class BeatRecord:
    """A beat as it was shown live: where it stopped (run log run and step), what it said and pointed at."""

    index: int
    title: str
    caption: str
    highlight: Highlight
    run_id: int | None
    step: int
    met: bool


FINISH_MAX_STEPS = 1000


class LessonDisplay(Protocol):
    def show_running(self, index: int, beat: Beat) -> None: ...
    def show_live(self, record: BeatRecord, result: StepResult) -> None: ...
    def show_past(self, record: BeatRecord) -> None: ...


class LessonRunner:
    def __init__(self, lesson: Lesson, config: EngineConfig, send, display: LessonDisplay, run_id=lambda: None):
        """``config`` is the engine config the lesson starts from (the teaching pool with the lesson's changes);
        ``send`` queues a worker command; ``run_id()`` is the run log id of the engine now running."""
        self.lesson = lesson
        self.config = config
        self._send = send
        self._display = display
        self._run_id = run_id
        self.records: list[BeatRecord] = []
        self.showing = -1           # the beat on screen
        self.running: int | None = None   # the beat the engine is running towards
        self._finishing = False     # the engine is finishing the last beat's requests before this one starts
        self.steps: list[StepRecord] = []
        self.earlier: dict[str, StepResult] = {}
        self.earlier_runs: dict[str, int] = {}
        self.run = 0                # engines built for the lesson so far
        self.infos: list[EngineInfo] = []   # each one's facts, in order
        self.latest: StepResult | None = None

    # --- driven by the screen ---------------------------------------------------------------

    def start(self) -> None:
        self._command(Rebuild(self.config))
        self._begin(0)

    def forward(self) -> bool:
        """Space: the next beat (replayed if it was shown before). False at the end or while running."""
        if self.running is not None:
            return False
        if self.showing < len(self.records) - 1:
            self.showing += 1
            self._show(self.showing)
            return True
        if len(self.records) < len(self.lesson.beats):
            self._begin(len(self.records))
            return True
        return False

    def back(self) -> bool:
        """Backspace: the beat before, replayed from the run log. False at the first beat or while running."""
        if self.running is not None or self.showing <= 0:
            return False
        self.showing -= 1
        self._show(self.showing)
        return True

    @property
    def finished(self) -> bool:
        return len(self.records) == len(self.lesson.beats) and self.running is None

    # --- fed by the app -------------------------------------------------------------------------

    def engine_ready(self, info: EngineInfo | None = None) -> None:
        self.run += 1
        if info is not None:
            self.infos.append(info)
        self.latest = None

    def stepped(self, result: StepResult) -> None:
        self.latest = result
        finished = tuple((o.request_id, sum(len(s.token_ids) for s in o.samples) or len(o.token_ids))
                         for o in result.outputs if o.finished)
        batch = sum(1 for v in result.snapshot.requests if v.queue == "running")
        generated = tuple((v.request_id, v.num_output_tokens) for v in result.snapshot.requests) + \
            tuple((o.request_id, len(o.token_ids)) for o in result.outputs if o.finished)
        self.steps.append(StepRecord(self.run, result.stats, result.events, finished, batch, generated))

    def until_done(self, step: int, met: bool) -> None:
        if self.running is None:
            return
        if self._finishing:
            self._finishing = False
            self._start(self.running)
            return
        self._reach(met)

    # --- beats ----------------------------------------------------------------------------------

    def _command(self, command: WorkerCommand) -> None:
        self._send(command)

    def _begin(self, index: int) -> None:
        beat = self.lesson.beats[index]
        self.running = index
        self._display.show_running(index, beat)
        if beat.config is not None and self.latest is not None and self.latest.snapshot.requests:
            self._finishing = True      # the engine about to be replaced finishes its requests first
            self._command(RunUntil(all_done, FINISH_MAX_STEPS))
            return
        self._start(index)

    def _start(self, index: int) -> None:
        beat = self.lesson.beats[index]
        # Paused first: the engine may be running (the app's was; the user may have resumed it), and a beat's load
        # must wait for its RunUntil. Commands can reach the engine one at a time (an engine process reads them off
        # a pipe), so a running engine could otherwise run the load to its end before the condition arrives.
        self._command(SetPaused(True))
        if beat.config is not None:
            self._command(Rebuild(dataclasses.replace(self.config, **beat.config)))
        if beat.load is not None:
            self._command(LaunchPlan(beat.load))
        already = beat.config is None and beat.load is None and self.latest is not None and \
            beat.until is not None and beat.until(self.latest)
        if beat.until is not None and not already:
            self._command(RunUntil(beat.until, beat.max_steps))
        else:
            self._reach(met=True)     # nothing to run for (a closing beat), or its moment is the step on screen

    def _reach(self, met: bool) -> None:
        index = self.running
        beat = self.lesson.beats[index]
        result = self.latest
        if result is None:      # the beat ran no step (nothing to run): nothing to talk about
            result = self._empty_result()
        moment = Moment(result, tuple(self.steps), dict(self.earlier), self.run, met, tuple(self.infos),
                        dict(self.earlier_runs))
        caption, highlight = _words(beat, moment)
        record = BeatRecord(index, beat.title, caption, highlight, self._run_id(), result.stats.step, met)
        self.earlier[beat.key] = result
        self.earlier_runs[beat.key] = self.run
        self.records.append(record)
        self.running = None
        self.showing = index
        self._display.show_live(record, result)

    def _show(self, index: int) -> None:
        record = self.records[index]
        if index == len(self.records) - 1 and self.latest is not None:
            self._display.show_live(record, self.latest)
        else:
            self._display.show_past(record)

    def _empty_result(self) -> StepResult:
        from kvscope.app.widgets.snapshot_view import empty_step

        snapshot, stats = empty_step(self.config.num_blocks or 1, self.config.block_size, self.config.allocator)
        return StepResult([], stats, snapshot)


def _words(beat: Beat, moment: Moment) -> tuple[str, Highlight]:
    """The beat's caption and highlight. A caption reads the numbers of the moment it was written for; if the
    run did not get there (another model's tokenizer, a pool too small), the screen says so instead of failing."""
    try:
        return beat.say(moment), beat.point(moment)
    except Exception as exc:  # the lesson goes on: the class still sees the engine as it is
        return (f"[b]This run did not reach the moment this beat is about[/b] ({type(exc).__name__}: {exc}). The "
                "screen shows the engine as it is; Space goes on.", Highlight())
