"""Playing a lesson from start to end without a person: Space at every beat as soon as it is shown.

What the bench (`kvscope bench lessons`), the screenshots and the tests use to
drive the real app through a lesson; ``on_beat`` sees each beat while it is on
screen.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvscope.app.headless import wait_until
from kvscope.app.lessons import LESSONS
from kvscope.app.lessons.runner import BeatRecord

BEAT_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Played:
    name: str
    beats: tuple[BeatRecord, ...]
    seconds: float          # from the lesson's start to its last beat on screen
    engine_seconds: float   # the engine's own time in step() over the lesson's steps
    steps: int


async def play(pilot, name: str, on_beat: Callable[[int, BeatRecord], Awaitable[None]] | None = None,
               beat_timeout: float = BEAT_TIMEOUT_S, stop_at: int | None = None) -> Played:
    """Play lesson ``name`` to its end, or until beat ``stop_at`` (0-based) is on screen."""
    app = pilot.app
    lesson = LESSONS[name]
    start = time.monotonic()
    app.start_lesson(name)
    await wait_until(pilot, lambda: app.lesson_screen is not None and app.lesson_screen.runner is not None)
    screen = app.lesson_screen
    runner = screen.runner
    last = len(lesson.beats) - 1 if stop_at is None else stop_at
    for index in range(last + 1):
        reached = await wait_until(pilot, lambda i=index: len(runner.records) > i and runner.running is None,
                                   beat_timeout)
        if not reached:
            raise RuntimeError(f"lesson {name}: beat {index + 1} not reached within {beat_timeout:.0f} s")
        if on_beat is not None:
            await on_beat(index, runner.records[index])
        if index < last:
            screen.action_forward()
    seconds = time.monotonic() - start
    engine_seconds = sum(record.stats.duration for record in runner.steps)
    return Played(name, tuple(runner.records), seconds, engine_seconds, len(runner.steps))
