"""`kvscope bench lessons`: how long each lesson takes on this machine with the real model.

Every lesson is played in one app (headless Textual, the model loaded once),
with Space pressed the moment each beat is shown, so the figure is the
machine's time, not a class's: the wall-clock from the lesson's start to its
closing figures, and the engine's own share of it (time inside ``step()``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

from kvscope.app.lessons import LESSONS
from kvscope.engine.config import EngineConfig

WINDOW = (120, 40)


@dataclass(frozen=True)
class LessonTiming:
    name: str
    beats: int
    steps: int
    engine_seconds: float
    seconds: float


async def _play_all(config: EngineConfig, names: list[str], db_path, log_enabled: bool
                    ) -> tuple[float, list[LessonTiming]]:
    from kvscope.app.app import KVScopeApp
    from kvscope.app.headless import wait_until
    from kvscope.app.lessons.load import teach_config
    from kvscope.app.lessons.play import play

    app = KVScopeApp(teach_config(config), db_path=db_path, log_enabled=log_enabled, paused=True)
    timings = []
    async with app.run_test(size=WINDOW) as pilot:
        start = time.monotonic()
        await wait_until(pilot, lambda: app.main.engine_info is not None, 600)
        load_seconds = time.monotonic() - start
        for name in names:
            model = LESSONS[name].config.get("model")
            if model and (hint := app.fetch_hint(model)):
                print(f"  {name}: skipped: it runs on {model}, and {hint}", file=sys.stderr, flush=True)
                continue
            played = await play(pilot, name)   # the next lesson replaces the last one's screen
            timings.append(LessonTiming(name, len(played.beats), played.steps, played.engine_seconds,
                                        played.seconds))
            print(f"  {name}: {played.seconds:.1f} s", file=sys.stderr, flush=True)
    return load_seconds, timings


def time_lessons(config: EngineConfig, names: list[str] | None = None, db_path=None,
                 log_enabled: bool = True) -> tuple[float, list]:
    """(seconds to load the model, one LessonTiming per lesson). With the log off, the lessons keep a
    temporary one (they go back by replaying it)."""
    return asyncio.run(_play_all(config, names or list(LESSONS), db_path, log_enabled))


def format_table(load_seconds: float, timings: list[LessonTiming]) -> str:
    import torch

    lines = [f"model load {load_seconds:.1f} s (once, before the first lesson); {torch.get_num_threads()} torch "
             "threads",
             f"{'lesson':<22}{'beats':>6}{'steps':>7}{'engine s':>10}{'wall s':>9}"]
    lines += [f"{t.name:<22}{t.beats:>6}{t.steps:>7}{t.engine_seconds:>10.1f}{t.seconds:>9.1f}" for t in timings]
    total = sum(t.seconds for t in timings)
    lines.append(f"{'all ' + str(len(timings)) if len(timings) == len(LESSONS) else 'total':<22}{'':>6}"
                 f"{sum(t.steps for t in timings):>7}{sum(t.engine_seconds for t in timings):>10.1f}{total:>9.1f}")
    return "\n".join(lines)
