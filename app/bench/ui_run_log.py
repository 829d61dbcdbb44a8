"""`kvscope bench ui`'s run-log rows: what recording every step costs the engine at the bench's pool.

kvscope logs every run by default, in the engine's process: the engine thread hands each step to a RunLogger,
whose writer thread encodes it and writes it to SQLite. So the engine thread pays for the hand-over, for holding
the step until the writer takes it (up to a tenth of a second), and for waiting on the interpreter lock while the
writer encodes; the writer's CPU runs on another core.

One engine in the bench's process steps in segments alone and recording (to a temporary database), alternated
``rounds`` times, each side first in turn: the requests' contexts grow as the run goes, and neither side always
runs on the longer ones. Before each segment the writer has caught up with the last, so a segment alone never
runs beside it. Per step: the engine thread's CPU, wall-clock time, and the writer thread's CPU.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvscope.app.bench.scoreboard import UiSettings
from kvscope.app.bench.ui import full_engine

# The writer has caught up once its CPU clock stood still this long (it gathers records for FLUSH_INTERVAL_S).
WRITER_IDLE_S = 0.25


@dataclass(frozen=True)
class LogCost:
    steps: int                      # a side
    alone_engine_ms: float          # the engine thread's CPU a step
    logging_engine_ms: float
    alone_wall_ms: float            # wall-clock a step
    logging_wall_ms: float
    writer_ms: float                # the writer thread's CPU a step recorded
    steps_written: int              # the steps the log holds once closed: every step recorded, if none dropped

    @property
    def engine_cost(self) -> float:
        return self.logging_engine_ms / self.alone_engine_ms - 1

    @property
    def wall_cost(self) -> float:
        return self.logging_wall_ms / self.alone_wall_ms - 1

    def rows(self, rounds: int) -> list[tuple[str, str]]:
        return [
            ("the run log", f"on by default, in the engine's process; one engine alone and recording, {rounds} "
                            "segments a side, alternated"),
            ("  engine thread per step", f"{self.alone_engine_ms:.2f} ms alone, {self.logging_engine_ms:.2f} ms "
                                         f"recording ({100 * self.engine_cost:+.1f}%)"),
            ("  wall-clock per step", f"{self.alone_wall_ms:.2f} ms alone, {self.logging_wall_ms:.2f} ms recording "
                                      f"({100 * self.wall_cost:+.1f}%)"),
            ("  writer thread per step", f"{self.writer_ms:.2f} ms, on another core; {self.steps_written:,} of "
                                         f"{self.steps:,} steps recorded in the log"),
        ]

    def as_json(self) -> dict:
        return {**vars(self), "engine_cost": self.engine_cost, "wall_cost": self.wall_cost}


def measure_log_cost(settings: UiSettings) -> LogCost:
    from kvscope.app.runlog.opening import open_run_log
    from kvscope.app.runlog.reader import RunLogReader

    engine = full_engine(settings)._engine
    segment = max(1, settings.steps // settings.rounds)
    # [engine thread ns, wall ns] a side, and the writer's CPU ns
    sides = {"alone": [0, 0], "logging": [0, 0]}
    writer_ns = 0
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as scratch:
        logger = open_run_log(Path(scratch) / "runs.db", source="bench", config=engine.config, model="FakeRunner",
                              device="cpu", dtype="none")
        if not logger.enabled:
            raise RuntimeError(f"the run log did not open: {logger.warning}")
        writer_clock = time.pthread_getcpuclockid(logger.writer.ident)
        gc.collect()
        gc.freeze()     # as the engine's process does once its engine is built (app/worker/process.py)
        try:
            _segment(engine, segment, None)     # a warm-up, unmeasured
            for turn in range(settings.rounds):
                for side in ("alone", "logging") if turn % 2 == 0 else ("logging", "alone"):
                    writer_before = time.clock_gettime_ns(writer_clock)
                    engine_ns, wall_ns = _segment(engine, segment, logger if side == "logging" else None)
                    sides[side][0] += engine_ns
                    sides[side][1] += wall_ns
                    writer_ns += _caught_up(writer_clock) - writer_before
        finally:
            gc.unfreeze()
            logger.close()
        reader = RunLogReader(Path(scratch) / "runs.db")
        steps_written = reader.run(logger.run_id)["num_steps"]
        reader.close()
    steps = segment * settings.rounds
    per_step = 1e6 * steps
    return LogCost(steps=steps, alone_engine_ms=sides["alone"][0] / per_step,
                   logging_engine_ms=sides["logging"][0] / per_step, alone_wall_ms=sides["alone"][1] / per_step,
                   logging_wall_ms=sides["logging"][1] / per_step, writer_ms=writer_ns / per_step,
                   steps_written=steps_written)


def _segment(engine, steps: int, logger) -> tuple[int, int]:
    """(engine thread CPU ns, wall ns) of ``steps`` steps, each handed to ``logger`` where there is one, as the
    app's worker hands it."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(steps):
        result = None   # the last step's result is let go of before the next, as the worker's loop does
        result = engine.step()
        if logger is not None:
            logger.step(result)
    return time.thread_time_ns() - cpu, time.perf_counter_ns() - wall


def _caught_up(writer_clock: int) -> int:
    """The writer's CPU clock once it has stood still for WRITER_IDLE_S."""
    last = time.clock_gettime_ns(writer_clock)
    while True:
        time.sleep(WRITER_IDLE_S)
        now = time.clock_gettime_ns(writer_clock)
        if now == last:
            return now
        last = now
