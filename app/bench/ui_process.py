"""`kvscope bench ui`'s process side: the engine in a process of its own (app/worker/process.py), alone and with
the window open on it, in that one process.

An engine stepped in a freshly started process ran 15-30% slower on this machine than the bench's own, and fresh
processes differed by up to 15% among themselves: comparing a headless process with a windowed one measured the
processes more than the window. So one engine process does both, in alternating segments, and its engine is the
same engine at the same steps either way:

- alone: the engine's ``step`` called in a loop on the engine thread, its results dropped, as a headless loop
  would (``AlternatingEngine`` does this inside one of the worker's steps, so the window sees nothing of it);
- with the window: the worker's own steps, each posted to the window over the pipe, as the app runs them.

After each segment alone, SETTLE_STEPS steps with the window go unmeasured: the block chain the window follows
broke there, and the first post after it carries the arrays whole, a one-off of the bench's making. Both sides
are timed in the engine process's CPU (every thread of it: the engine thread, the thread that takes the window's
commands, the pickling for the pipe); the window's process runs on another core and is timed apart. Steps per
wall-clock second are shown too: a window that reads its posts slowly costs the engine time it spends waiting,
which no CPU clock counts.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from kvscope.app.bench.scoreboard import UiSettings
from kvscope.app.bench.ui import full_engine

SETTLE_STEPS = 60       # two posts and more at the bench's step rate


class AlternatingEngine:
    """The engine process's engine for the bench: ``warmup`` steps with the window, then ``rounds`` turns of a
    segment alone (followed by SETTLE_STEPS with the window, unmeasured) and a segment with the window measured
    (``steps`` measured a side in all). Writes what it measured to ``report`` once done; steps on with the window
    after."""

    def __init__(self, engine, report: Path, warmup: int, steps: int, rounds: int) -> None:
        self._engine = engine
        self._report = report
        self._worker_steps = 0
        segment = max(1, steps // rounds)
        settle = min(SETTLE_STEPS, segment)     # within the steps full_engine's requests have to run
        alone, settled, measured = ("alone", segment), ("window", settle), ("measured", segment)
        # In turns, each side first: the requests' contexts grow as the run goes, and neither side always runs
        # on the longer ones.
        self._phases = [("window", warmup)] + [phase for turn in range(rounds) for phase in
                                              ((alone, settled, measured) if turn % 2 == 0 else
                                               (measured, alone, settled))]
        self._kind, self._left, self._segment_steps, self._segment_cpu, self._segment_wall = "", 0, 0, 0.0, 0.0
        # Per side: process CPU seconds, steps, the engine thread's CPU nanoseconds in the engine's own step, and
        # wall-clock seconds.
        self.sides = {"alone": [0.0, 0, 0, 0.0], "measured": [0.0, 0, 0, 0.0]}
        self.segment_rates: dict[str, list[float]] = {"alone": [], "measured": []}   # steps per CPU second, each
        self.usage = 0.0

    def step(self):
        if not self._left:
            self._begin(*(self._phases.pop(0) if self._phases else ("after", -1)))
        kind = self._kind
        start = time.thread_time_ns()
        result = self._engine.step()
        self._worker_steps += 1
        self._left -= 1
        if kind == "measured":
            self.sides[kind][2] += time.thread_time_ns() - start
            if not self._left:
                self._end_segment(kind, result)
        return result

    def _begin(self, kind: str, steps: int) -> None:
        self._kind, self._left, self._segment_steps = kind, steps, steps
        self._segment_cpu = time.process_time()
        self._segment_wall = time.perf_counter()
        if kind == "alone":     # the whole segment now, inside this one step of the worker's
            side = self.sides[kind]
            result = None
            for _ in range(steps):
                result = None   # freed outside the timing, as the worker's steps are (they free theirs later)
                start = time.thread_time_ns()
                result = self._engine.step()
                side[2] += time.thread_time_ns() - start
            self._end_segment(kind, result)
            self._begin(*self._phases.pop(0))

    def _end_segment(self, kind: str, result) -> None:
        side = self.sides[kind]
        cpu = time.process_time() - self._segment_cpu
        side[0] += cpu
        self.segment_rates[kind].append(self._segment_steps / cpu)
        side[3] += time.perf_counter() - self._segment_wall
        side[1] += self._segment_steps
        self.usage = result.stats.kv_usage
        if all(kind == "window" for kind, _ in self._phases):    # nothing left to measure
            partial = self._report.with_suffix(".part")
            partial.write_text(json.dumps({"sides": self.sides, "segment_rates": self.segment_rates,
                                           "usage": self.usage, "steps": self._worker_steps}))
            partial.replace(self._report)     # whole or not at all: the bench polls for it

    def has_unfinished_requests(self) -> bool:   # the worker asks every step: not through __getattr__
        return self._engine.has_unfinished_requests()

    def __getattr__(self, name):     # otherwise it is the engine
        return getattr(self._engine, name)


class MeasuredEngines:
    """The engine factory the engine process is given (pickled: plain values only)."""

    def __init__(self, settings: UiSettings, report: str) -> None:
        self.settings = settings
        self.report = report

    def __call__(self, config, previous=None):
        s = self.settings
        return AlternatingEngine(full_engine(s)._engine, Path(self.report), s.steps, s.steps, s.rounds)


async def process_window_run(settings: UiSettings) -> dict:
    """The window open on an engine process that alternates segments alone and with the window (see the
    module's doc)."""
    from kvscope.app.app import KVScopeApp
    from kvscope.app.headless import wait_until
    from kvscope.app.worker.commands import SetPaused
    from kvscope.engine.config import EngineConfig

    with tempfile.TemporaryDirectory(prefix="kvscope-bench-ui-") as folder:
        report = Path(folder) / "measured.json"
        config = EngineConfig(num_blocks=settings.blocks)   # the header's until the engine says its own
        app = KVScopeApp(config, log_enabled=False, engine_process=True, paused=True,
                         engine_factory=MeasuredEngines(settings, str(report)))
        built = app.worker.wait_until_built(600)
        if built is None or not hasattr(built, "info"):
            raise RuntimeError(f"the engine process did not build its engine: {getattr(built, 'error', 'timeout')}")
        async with app.run_test(size=settings.size) as pilot:
            if not await wait_until(pilot, lambda: app.main.engine_info is not None, 120):
                raise RuntimeError("the app did not take the engine within 120 s")
            posts = _count_posts(app.worker)
            ui_cpu = time.process_time()
            app.worker.send(SetPaused(False))
            if not await wait_until(pilot, report.exists, 3600):
                raise RuntimeError("the engine process stopped stepping")
            ui_cpu = time.process_time() - ui_cpu
            app.worker.send(SetPaused(True))
        measured = json.loads(report.read_text())
    return measured | {"ui_cpu": ui_cpu, "posts": posts}


def _count_posts(engine_process) -> list[int]:
    """The steps of each batch the window takes (it hands each batch back in one ``ack``)."""
    posts: list[int] = []
    ack = engine_process.ack

    def counting_ack(steps: int = 1) -> None:
        posts.append(steps)
        ack(steps)

    engine_process.ack = counting_ack
    return posts


def process_sides(settings: UiSettings, say) -> dict:
    """Steps per CPU second of the engine's process alone and with the window open, the engine thread's CPU a
    step on each, the window's process's CPU per engine step it was sent, and steps per wall-clock second."""
    import asyncio

    say(f"engine process: {settings.rounds} segments alone and as many with the window open, alternated")
    run = asyncio.run(process_window_run(settings))
    (alone_cpu, alone_steps, alone_ns, alone_wall), (window_cpu, window_steps, window_ns, window_wall) = (
        run["sides"]["alone"], run["sides"]["measured"])
    sent = run["steps"]     # the steps the window was sent, measured or not (the engine's alone are not counted)
    # Each turn's own cost (its segment alone against its segment with the window): their spread is the run's noise.
    turns = [1 - window / alone for alone, window in zip(run["segment_rates"]["alone"],
                                                          run["segment_rates"]["measured"], strict=True)]
    # Every step the window was sent came in a post (the engine's alone are not sent): their mean size, and so
    # how often the window moved while it kept up with the engine.
    steps_per_post = sum(run["posts"]) / max(1, len(run["posts"]))
    return {"headless_steps_per_cpu_s": alone_steps / alone_cpu, "window_steps_per_cpu_s": window_steps / window_cpu,
            "turn_costs": turns,
            "headless_engine_ms": alone_ns / alone_steps / 1e6, "window_engine_ms": window_ns / window_steps / 1e6,
            "ui_ms": run["ui_cpu"] / sent * 1e3,
            "headless_steps_per_s": alone_steps / alone_wall, "window_steps_per_s": window_steps / window_wall,
            "steps_per_post": steps_per_post, "posts_per_s": window_steps / window_wall / steps_per_post}
