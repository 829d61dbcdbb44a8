"""`kvscope bench ui`'s process sides: the engine in a process of its own (app/worker/process.py), headless and
with the window open on it.

An engine stepped in a freshly started process ran 15-30% slower on this machine than the bench's own
headless engine (the same steps; the heap it lands in), and fresh processes differed by up to 15% among
themselves. So the window on an engine process is compared with the same engine stepped headless in a fresh
process of the same kind, ``--rounds`` times each, alternated, medians compared.

The engine process builds the same engine as the other sides (``full_engine``: a FakeRunner pool filled the same
way) and measures itself, as WindowedEngine does on a thread: the warm-up steps, then the measured steps, timed in
the engine process's CPU (every thread of it: the engine thread, the thread that takes the window's commands, the
pickling of the steps for the pipe). It writes what it measured to a file the bench reads once the measured steps
are done. The window's process is timed apart, over the warm-up and the measured steps together.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from kvscope.app.bench.scoreboard import UiSettings
from kvscope.app.bench.ui import WindowedEngine, full_engine, headless_rate


class _ReportingEngine(WindowedEngine):
    """A WindowedEngine that writes its measurement to ``report`` once its measured steps are done."""

    def __init__(self, windowed: WindowedEngine, report: Path, steps: int) -> None:
        super().__init__(windowed._engine, keep=1)
        self._report = report
        self.measure(steps, steps)

    def step(self):
        result = super().step()
        if self.stopped is not None and not self._report.exists():
            (cpu, _), (stopped_cpu, _, usage) = self.started, self.stopped
            first = self.start_at
            body = {"cpu": stopped_cpu - cpu, "usage": usage, "engine_ms": self.engine_ms(first, self.stop_at)}
            partial = self._report.with_suffix(".part")
            partial.write_text(json.dumps(body))
            partial.replace(self._report)     # whole or not at all: the bench polls for it
        return result


class MeasuredEngines:
    """The engine factory the engine process is given (pickled: plain values only)."""

    def __init__(self, settings: UiSettings, report: str) -> None:
        self.settings = settings
        self.report = report

    def __call__(self, config, previous=None):
        return _ReportingEngine(full_engine(self.settings), Path(self.report), self.settings.steps)


async def process_window_run(settings: UiSettings) -> dict:
    """{"steps", "cpu" (the engine process's, over the measured steps), "engine_ms", "ui_ms", "usage"}."""
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
            ui_cpu = time.process_time()
            app.worker.send(SetPaused(False))
            if not await wait_until(pilot, report.exists, 3600):
                raise RuntimeError("the engine process stopped stepping")
            ui_cpu = time.process_time() - ui_cpu
            app.worker.send(SetPaused(True))
        measured = json.loads(report.read_text())
    return measured | {"steps": settings.steps, "ui_ms": ui_cpu / (2 * settings.steps) * 1e3}


def _headless_child(settings: UiSettings, results) -> None:
    engine = full_engine(settings)
    gc.collect()
    gc.freeze()     # as the engine process does with each engine it builds
    headless_rate(engine, settings.steps)     # the warm-up the window's side gets
    first = len(engine.stats)
    steps, cpu = headless_rate(engine, settings.steps)
    results.put({"cpu": cpu, "steps": steps, "engine_ms": engine.engine_ms(first, first + settings.steps)})


def process_headless_run(settings: UiSettings) -> dict:
    """{"steps", "cpu", "engine_ms"}: the engine stepped headless in a fresh process."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_headless_child, args=(settings, results), name="kvscope-bench-headless")
    child.start()
    try:
        return results.get(timeout=3600)
    finally:
        child.join()


def process_sides(settings: UiSettings, say) -> dict:
    """Medians over ``settings.rounds`` alternated rounds: steps per CPU second of the engine's process headless
    and with the window open, the engine thread's CPU a step on each, and the window's process's CPU per engine
    step."""
    import asyncio

    headless, window = [], []
    for round_number in range(1, settings.rounds + 1):
        say(f"engine process, round {round_number} of {settings.rounds}: headless, then the window open on it")
        headless.append(process_headless_run(settings))
        window.append(asyncio.run(process_window_run(settings)))

    def median(runs, key):
        return statistics.median(run[key] for run in runs)

    return {"headless_steps_per_cpu_s": statistics.median(run["steps"] / run["cpu"] for run in headless),
            "window_steps_per_cpu_s": statistics.median(run["steps"] / run["cpu"] for run in window),
            "headless_engine_ms": median(headless, "engine_ms"), "window_engine_ms": median(window, "engine_ms"),
            "ui_ms": median(window, "ui_ms")}
