"""What a lesson is made of: beats, each a run of the real engine up to a moment, and words about it.

A lesson is data. Each beat says what to do before it can be shown (rebuild the
engine with other settings, send requests, run until a condition holds on a
step's result) and how to talk about the step it stopped at: a caption built
from that step's numbers and the requests or blocks to point at. The runner
(runner.py) does the doing; the lesson screen does the showing. Conditions (cues.py) run
on the engine thread after each step, so a beat stops at exactly the step where
its moment happens, never a few steps later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvscope.app.lessons.cues import Condition, all_done
from kvscope.app.load.presets import PlannedRequest, PresetContext
from kvscope.app.messages import EngineInfo
from kvscope.engine.outputs import CacheSnapshot, EngineEvent, RequestView, StepResult, StepStats

Plan = Callable[[PresetContext], list[PlannedRequest]]
DEFAULT_MAX_STEPS = 200


@dataclass(frozen=True)
class StepRecord:
    """One step of the lesson, kept for the closing figures. ``run`` counts the engines the lesson built."""

    run: int
    stats: StepStats
    events: tuple[EngineEvent, ...]
    finished: tuple[tuple[str, int], ...]       # (request id, tokens generated) of requests that ended
    batch: int                                  # requests that ran this step
    generated: tuple[tuple[str, int], ...] = ()   # (request id, tokens generated so far) of every request in it

    def tokens_of(self, request_id: str) -> int | None:
        """Tokens ``request_id`` had generated after this step; None if it was not in the engine."""
        return next((count for rid, count in self.generated if rid == request_id), None)


@dataclass(frozen=True)
class Moment:
    """What a caption reads: the step the beat stopped at, the beats before it, and every step so far."""

    result: StepResult
    steps: tuple[StepRecord, ...]
    earlier: dict[str, StepResult]              # the results of earlier beats, by beat key
    run: int                                    # which engine of the lesson this step ran on
    met: bool = True                            # False when the beat ran out of steps before its moment
    infos: tuple[EngineInfo, ...] = ()          # each engine the lesson built, in order (run 1 first)
    earlier_runs: dict[str, int] = field(default_factory=dict)   # the run each earlier beat stopped in

    @property
    def info(self) -> EngineInfo | None:
        """The engine this step ran on: its pool, model shape and dtype."""
        return self.infos[self.run - 1] if 0 < self.run <= len(self.infos) else None

    def info_at(self, key: str) -> EngineInfo:
        """The engine an earlier beat stopped on."""
        return self.infos[self.earlier_runs[key] - 1]

    @property
    def snapshot(self) -> CacheSnapshot:
        return self.result.snapshot

    @property
    def stats(self) -> StepStats:
        return self.result.stats

    def queued(self, queue: str, key: str | None = None) -> list[str]:
        """The ids of the requests in ``queue`` ("running", "waiting", "swapped") at this step, or at the step
        the earlier beat ``key`` stopped at."""
        snapshot = self.snapshot if key is None else self.earlier[key].snapshot
        return [view.request_id for view in snapshot.requests if view.queue == queue]

    def view(self, request_id: str) -> RequestView | None:
        return next((v for v in self.snapshot.requests if v.request_id == request_id), None)

    def table(self, request_id: str, sample: int = 0) -> tuple[int, ...]:
        view = self.view(request_id)
        return tuple(view.block_tables[sample]) if view is not None and len(view.block_tables) > sample else ()

    def run_steps(self, run: int | None = None) -> tuple[StepRecord, ...]:
        """The steps of one engine of the lesson (default: the current one)."""
        run = self.run if run is None else run
        return tuple(record for record in self.steps if record.run == run)


@dataclass(frozen=True)
class Highlight:
    """What a beat points at: a request to select (its blocks stand out, its table shows) and blocks to mark."""

    request_id: str | None = None
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Beat:
    """One pause of a lesson.

    Before it is shown: ``config`` rebuilds the engine with these EngineConfig changes (on top of the lesson's),
    ``load`` sends requests, and ``until`` runs the engine until the condition holds (at most ``max_steps``
    steps; None: no step at all). ``say`` writes the caption (markup) and ``point`` the highlight, both
    from the Moment the beat stopped at.
    """

    key: str
    title: str
    say: Callable[[Moment], str]
    until: Condition | None = None
    load: Plan | None = None
    config: dict[str, Any] | None = None
    point: Callable[[Moment], Highlight] = field(default=lambda moment: Highlight())
    max_steps: int = DEFAULT_MAX_STEPS


@dataclass(frozen=True)
class Lesson:
    name: str
    title: str
    summary: str                        # one sentence: what the class will see
    beats: tuple[Beat, ...]
    config: dict[str, Any] = field(default_factory=dict)   # EngineConfig changes on top of the teaching pool


def select(request_id: str) -> Callable[[Moment], Highlight]:
    """A beat's ``point`` that selects one request: its blocks stand out and its block table shows."""
    return lambda moment: Highlight(request_id)


def closing(title: str, say: Callable[[Moment], str]) -> Beat:
    """A lesson's last beat: its figures, said once every request of its last engine has finished, so they count
    every step of the run."""
    return Beat("figures", title, say, until=all_done)
