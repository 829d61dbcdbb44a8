"""What a lesson is made of: beats, each a run of the real engine up to a moment, and words about it.

A lesson is data. Each beat says what to do before it can be shown (rebuild the
engine with other settings, send requests, run until a condition holds on a
step's result) and how to talk about the step it stopped at: a caption built
from that step's numbers and the requests or blocks to point at. The runner
(runner.py) does the doing; the lesson screen does the showing. Conditions run
on the engine thread after each step, so a beat stops at exactly the step where
its moment happens, never a few steps later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvscope.app.load.presets import PlannedRequest, PresetContext
from kvscope.app.messages import EngineInfo
from kvscope.app.widgets.formatting import bar
from kvscope.engine.outputs import CacheSnapshot, EngineEvent, EventKind, RequestView, StepResult, StepStats

Condition = Callable[[StepResult], bool]
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


# --- conditions: each a function of one step's result ---------------------------------------


def after_steps(count: int) -> Condition:
    """Holds from the ``count``-th step of the current engine on."""
    return lambda result: result.stats.step >= count


def has_event(kind: EventKind, request_id: str | None = None) -> Condition:
    return lambda result: any(e.kind == kind and (request_id is None or e.request_id == request_id)
                              for e in result.events)


def is_running(request_id: str) -> Condition:
    return lambda result: any(v.request_id == request_id and v.queue == "running"
                              for v in result.snapshot.requests)


def has_finished(request_id: str) -> Condition:
    return lambda result: any(o.request_id == request_id and o.finished for o in result.outputs)


def all_done(result: StepResult) -> bool:
    return not result.snapshot.requests


def prefilled(request_id: str) -> Condition:
    """Holds once the request's whole prompt is computed (it has produced a token)."""
    return lambda result: any(v.request_id == request_id and v.num_output_tokens > 0
                              for v in result.snapshot.requests)


def every(*conditions: Condition) -> Condition:
    return lambda result: all(condition(result) for condition in conditions)


# --- words ---------------------------------------------------------------------------------------


def arrows(blocks) -> str:
    """A block table as the class reads it: 12 → 40 → 7."""
    return " → ".join(str(b) for b in blocks) or "(no blocks)"


def plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


# The lesson panel's text width at 120x40, the size a class projects: a table or a bar chart wider than this
# wraps into nonsense there, where prose merely wraps.
CAPTION_WIDTH = 42
# A measured difference smaller than this share of the larger figure is not told as an effect: a busy CPU's step
# times vary by that much from run to run, and a step's fixed cost can be most of a small step.
NOISE = 0.15


def compared(a: float, b: float, noise: float = NOISE) -> int:
    """+1 when ``b`` is above ``a`` by more than ``noise`` of the larger, -1 when below, 0 within it: what a
    caption may say of two measured figures."""
    top = max(abs(a), abs(b))
    if top == 0 or abs(b - a) <= noise * top:
        return 0
    return 1 if b > a else -1


def bars(rows: list[tuple[str, float, str]], width: int | None = None) -> list[str]:
    """A horizontal bar chart: one "label ██████▌ value" line per (label, amount, value text), the longest bar
    ``width`` cells (default: what CAPTION_WIDTH leaves beside the labels and values), so amounts read against
    each other at a glance."""
    longest = max((amount for _, amount, _ in rows), default=0) or 1
    label_width = max(len(label) for label, _, _ in rows)
    if width is None:
        width = max(4, CAPTION_WIDTH - label_width - 2 - max(len(value) for _, _, value in rows))
    return [f"{label:<{label_width}} [$accent]{bar(amount / longest, width)}[/] {value}"
            for label, amount, value in rows]


SPARKS = "▁▂▃▄▅▆▇█"


def spark(values: list[float]) -> str:
    """A one-line plot of ``values``, one cell each, the largest a full cell."""
    top = max(values, default=0) or 1
    return "".join(SPARKS[min(len(SPARKS) - 1, round(v / top * (len(SPARKS) - 1)))] for v in values)


def figures(rows: list[tuple[str, str]], note: str = "") -> str:
    """The closing figures: "label  value" lines, labels padded to the longest, then a sentence."""
    width = max(len(label) for label, _ in rows)
    # A value too long for its row goes under its label, indented, rather than wrapping under the labels.
    lines = [f"{label:<{width}}  {value}" if width + 2 + len(value) <= CAPTION_WIDTH else f"{label}\n  {value}"
             for label, value in rows]
    return "[b]The figures of this run[/b]\n" + "\n".join(lines) + (f"\n\n{note}" if note else "")
