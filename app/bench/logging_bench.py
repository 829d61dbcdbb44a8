"""`kvscope bench logging`: what the run log costs.

The same workload through kvscope-paged with logging off and on, in one process,
in the order off, on, on, off per repeat so that drift in machine load falls on
both sides equally. Reports on/off throughput and database bytes per 1000 steps.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvscope.app.bench.kvscope_system import VARIANTS, KvscopeRun, engine_config
from kvscope.app.bench.metrics import ratio
from kvscope.app.bench.systems import PAGED
from kvscope.app.bench.workloads import BenchRequest, Workload, warm_up_request

SYSTEM = PAGED
ORDER = (False, True, True, False)  # logging on? per run, per repeat


class LogUnavailable(RuntimeError):
    """The run log could not be opened, so there is nothing to measure."""


@dataclass
class LoggingResult:
    workload: str
    dtype: str
    requests: int
    runs_per_side: int
    off_output_tokens_per_s: float
    on_output_tokens_per_s: float
    on_off_ratio: float
    steps_logged: int
    db_bytes: int
    db_bytes_per_1000_steps: float | None
    db_path: str

    def as_json(self) -> dict:
        return {"bench": "logging", **self.__dict__}

    def text(self) -> str:
        per_1000 = self.db_bytes_per_1000_steps
        return "\n".join([
            f"logging · {self.workload} · {self.dtype} · {self.requests} requests · "
            f"{self.runs_per_side} runs each side, order off/on/on/off",
            f"  logging off: {self.off_output_tokens_per_s:.1f} output tok/s",
            f"  logging on:  {self.on_output_tokens_per_s:.1f} output tok/s",
            f"  on / off:    {self.on_off_ratio:.3f}  (target >= 0.95)",
            f"  database:    {self.db_bytes:,} bytes for {self.steps_logged:,} steps = "
            + (f"{per_1000 / 1024:,.1f} KiB per 1000 steps" if per_1000 is not None else "no steps logged")
            + f"  ({self.db_path})",
        ])


def database_bytes(path: Path) -> int:
    """The file plus its write-ahead log, which holds commits not yet checkpointed."""
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def count_steps(path: Path, run_ids: list[int]) -> int:
    if not run_ids:
        return 0
    with sqlite3.connect(path) as db:
        marks = ",".join("?" * len(run_ids))
        return db.execute(f"SELECT count(*) FROM steps WHERE run_id IN ({marks})", run_ids).fetchone()[0]


def run_logging_bench(make_engine: Callable, open_log: Callable, workload: Workload, *, db_path: Path,
                      model: str, device: str, dtype: str, repeats: int = 1,
                      warm_up: BenchRequest | None = None,
                      progress: Callable[[str], None] = print) -> LoggingResult:
    """``open_log(engine)`` must record the engine's run in ``db_path``; ``make_engine(config)`` builds each
    engine."""
    variant = VARIANTS[SYSTEM]
    config = engine_config(variant, workload, model=model, device=device, dtype=dtype)
    warm_up = warm_up or warm_up_request()
    bytes_before = database_bytes(db_path)
    tokens = {False: 0, True: 0}
    seconds = {False: 0.0, True: 0.0}
    run_ids: list[int] = []

    def logged(engine):
        logger = open_log(engine)
        if not logger.enabled:
            raise LogUnavailable(logger.warning)
        run_ids.append(logger.run_id)
        return logger

    for _ in range(repeats):
        for logging_on in ORDER:
            run = KvscopeRun(variant, make_engine, logged if logging_on else None)
            record = run.run(workload, warm_up, config)
            tokens[logging_on] += record.num_output_tokens
            seconds[logging_on] += record.wall_s
            progress(f"  logging {'on ' if logging_on else 'off'}: "
                     f"{record.num_output_tokens / record.wall_s:.1f} output tok/s")
    off, on = tokens[False] / seconds[False], tokens[True] / seconds[True]
    steps = count_steps(db_path, run_ids)
    size = database_bytes(db_path) - bytes_before
    return LoggingResult(
        workload=workload.name, dtype=dtype, requests=len(workload.requests), runs_per_side=2 * repeats,
        off_output_tokens_per_s=off, on_output_tokens_per_s=on, on_off_ratio=on / off,
        steps_logged=steps, db_bytes=size, db_bytes_per_1000_steps=ratio(1000 * size, steps),
        db_path=str(db_path),
    )
