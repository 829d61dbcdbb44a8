"""`kvscope bench ui`: what a block-map frame costs at a big pool, and what the open window and the run log cost
the engine.

Both on one engine: a FakeRunner (no model, no KV tensor) with ``--blocks`` blocks (default 330,000, about what
an H200 holds of SmolLM2 at 0.9 utilisation) of which ``--usage`` (default 80%) are held by ``--batch`` decoding
requests, each with a prompt of its own. One run, in this order:

1. Headless: the engine stepped ``--steps`` times from a thread of its own, as the app's engine thread steps it.
2. Window: the real app (KVScopeApp, headless Textual through ``run_test``, at ``--size``; the engine in its
   process, as ``kvscope --in-process`` and ``--serve`` run it) on a twin of that
   engine (built the same way and at the same time, before either side runs, so both sides run the same steps
   from the same heap: an engine whose step grows with what it has generated, or one built after another was
   freed, would otherwise charge that to the window), unpaused for ``--steps`` steps: the engine
   thread steps, the UI thread takes every step (``ingest``) and paints at its own frame rate under its CPU
   budget (app/screens/main.py).

Each side first takes as many steps again unmeasured. The window's first frames of a running engine lay the
screen out anew once (the header's state, the queues filling, a scrollbar appearing and the map re-fitting its
cells), a one-off of a few tenths of a second that a run of a few seconds would otherwise charge as a steady
share of the engine's throughput; the warm-up keeps it out, and keeps both engines at the same step.
3. Frames: the window's own BlockMap (its size in that window) shown each of the last ``--frames`` steps'
   snapshots and every line rendered (``show_snapshot`` then ``render_line`` for each row: the cells from the
   snapshot, then the strips; Textual's compositor pass is not included), before the app closes (closing it
   aborts the engine's requests).
4. The engine in a process of its own (``kvscope``'s default, app/bench/ui_process.py): alone and with
   the window open on it, in segments alternated ``--rounds`` times in that one process.
5. The run log (on by default, in the engine's process: app/bench/ui_run_log.py): one engine alone and recording
   every step, in segments alternated ``--rounds`` times.

Throughput is engine steps per CPU second of the whole process (time.process_time: the engine thread, the UI
thread and any other), so whatever the window spends holding the GIL counts against it, and the figure holds on
a machine shared with other work. Where that CPU went is split out: the engine thread's own per step (headless
and with the window open) and the UI thread's per engine step. Frame times are the UI thread's CPU
(time.thread_time_ns). On the process sides, throughput is per CPU second of the engine's process alone: the
window's process runs on another core and holds no lock the engine needs; its CPU is shown apart.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvscope.app.bench.host import BLOCK_SIZE, Spread, decoding_engine
from kvscope.app.bench.scoreboard import UiSettings
from kvscope.engine.outputs import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED, CacheSnapshot, RequestView, StepStats

if TYPE_CHECKING:
    from kvscope.app.bench.ui_run_log import LogCost


@dataclass(frozen=True)
class UiResult:
    settings: UiSettings
    usage: float                    # of the pool, when the frames were timed
    cells: int                      # the map's cells in the window
    blocks_per_cell: int
    frame: Spread                   # show_snapshot and every line, ms
    cells_ms: Spread                # show_snapshot alone
    headless_steps_per_cpu_s: float
    window_steps_per_cpu_s: float
    window_frames: int              # frames the window painted while measured
    longest_paint_ms: float         # the UI thread's longest single paint (the most it held the GIL at once)
    # Where the CPU went, ms per engine step: the engine thread's own, headless and with the window open, and the
    # UI thread's while the window was open.
    headless_engine_ms: float
    window_engine_ms: float
    window_ui_ms: float
    # The engine in a process of its own (app/bench/ui_process.py), alone and with the window open: engine steps
    # per CPU second of the engine's process, its engine thread's CPU a step, and the window's process's CPU per
    # engine step.
    process_headless_steps_per_cpu_s: float
    process_window_steps_per_cpu_s: float
    process_headless_engine_ms: float
    process_window_engine_ms: float
    process_ui_ms: float
    # ... and engine steps per wall-clock second of each side: what a window that reads its posts slowly holds back
    process_headless_steps_per_s: float
    process_window_steps_per_s: float
    process_turn_costs: tuple[float, ...]   # the window's cost in each turn of a segment alone and one with it
    process_posts_per_s: float      # batches of steps posted to the window a second, while it was open
    process_steps_per_post: float
    run_log: LogCost                # the run log's cost at the same pool (app/bench/ui_run_log.py)

    @property
    def window_cost(self) -> float:
        """The share of engine throughput the open window takes."""
        return 1 - self.window_steps_per_cpu_s / self.headless_steps_per_cpu_s

    @property
    def process_window_cost(self) -> float:
        """The same, with the engine in a process of its own."""
        return 1 - self.process_window_steps_per_cpu_s / self.process_headless_steps_per_cpu_s


class RecordingEngine:
    """Wraps an LLMEngine and keeps every step's stats; otherwise it is the engine."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.stats: list[StepStats] = []
        self.num_finished = 0

    def step(self):
        result = self._engine.step()
        self.stats.append(result.stats)
        self.num_finished += sum(output.finished for output in result.outputs)
        return result

    def __getattr__(self, name):
        return getattr(self._engine, name)


def synthetic_snapshot(num_blocks: int, num_requests: int, block_size: int = 16,
                       seed: int = 0) -> CacheSnapshot:
    """A busy pool: every request holds a random share of blocks, some shared, some cached-free."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_blocks)
    used_blocks = order[: int(num_blocks * 0.8)]
    cached_blocks = order[int(num_blocks * 0.8): int(num_blocks * 0.9)]
    tables = np.array_split(used_blocks, num_requests)
    state = np.full(num_blocks, BLOCK_FREE, dtype=np.int8)
    state[used_blocks], state[cached_blocks] = BLOCK_USED, BLOCK_CACHED
    refs = np.zeros(num_blocks, dtype=np.int32)
    refs[used_blocks] = 1
    fill = np.zeros(num_blocks, dtype=np.int16)
    fill[used_blocks] = block_size
    hashes = np.zeros(num_blocks, dtype=np.uint64)
    hashes[cached_blocks] = rng.integers(1, 2**62, cached_blocks.size, dtype=np.uint64)
    views = []
    for index, table in enumerate(tables):
        table = tuple(int(b) for b in table)
        if index and tables[0].size:
            shared = int(tables[0][0])
            table = (shared, *table)
            refs[shared] += 1
        if table:
            fill[table[-1]] = rng.integers(1, block_size + 1)
        views.append(RequestView(
            request_id=f"r{index}", queue="running", arrival_index=index, block_tables=(table,),
            host_block_tables=(), num_prompt_tokens=32, num_output_tokens=len(table), max_tokens=256,
            num_computed_tokens=len(table) * block_size, num_cached_tokens=0, num_preemptions=0,
            num_samples=1,
            reserved_slots=len(table) * block_size, used_slots=len(table) * block_size))
    return CacheSnapshot(step=seed, block_size=block_size, num_blocks=num_blocks, allocator="paged",
                         block_state=state, ref_counts=refs, block_fill=fill, block_hashes=hashes,
                         requests=tuple(views))


class WindowedEngine(RecordingEngine):
    """The engine as the app's worker steps it. Once ``measure(warmup, n)`` is set, the steps that end the warm-up
    and the ``n`` measured steps after it note the process CPU time (and the last, the pool's usage) on the engine
    thread, so the window's side is measured to the step (the engine may run on until the app pauses it); the
    snapshots of the steps before the last are kept for the frame timing."""

    def __init__(self, engine, keep: int) -> None:
        super().__init__(engine)
        self.recent: collections.deque[CacheSnapshot] = collections.deque(maxlen=keep)
        self.step_cpu_ns: list[int] = []      # the stepping thread's CPU in each step
        self.start_at: int | None = None
        self.stop_at: int | None = None
        # At start_at: (process CPU seconds, the UI thread's CPU nanoseconds); at stop_at, and the kv usage.
        self.started: tuple[float, int] | None = None
        self.stopped: tuple[float, int, float] | None = None
        self._ui_clock = time.pthread_getcpuclockid(threading.main_thread().ident)   # the app's loop runs there

    def ui_cpu_ns(self) -> int:
        return time.clock_gettime_ns(self._ui_clock)

    def measure(self, warmup: int, steps: int) -> None:
        self.started = self.stopped = None
        self.start_at = len(self.stats) + warmup
        self.stop_at = self.start_at + steps

    @property
    def measuring(self) -> bool:
        return self.started is not None and self.stopped is None

    def step(self):
        start = time.thread_time_ns()
        result = super().step()
        self.step_cpu_ns.append(time.thread_time_ns() - start)
        if self.stop_at is None or len(self.stats) <= self.stop_at:
            self.recent.append(result.snapshot)
        if len(self.stats) == self.start_at:
            self.started = (time.process_time(), self.ui_cpu_ns())
        if len(self.stats) == self.stop_at:
            self.stopped = (time.process_time(), self.ui_cpu_ns(), result.stats.kv_usage)
        return result

    def engine_ms(self, first: int, last: int) -> float:
        """The stepping thread's mean CPU milliseconds per step over steps ``first`` to ``last``."""
        return sum(self.step_cpu_ns[first:last]) / max(1, last - first) / 1e6


def full_engine(settings: UiSettings) -> WindowedEngine:
    """``settings.batch`` decoding requests holding about ``settings.usage`` of a pool of ``settings.blocks``."""
    max_tokens = 5 * settings.steps + settings.frames + 8     # nobody finishes during the run (warm-ups too)
    per_request = int(settings.blocks * settings.usage) // settings.batch * BLOCK_SIZE
    context = per_request - max_tokens // 2     # the pool fills to about ``usage`` by the middle of the run
    if context < 1:
        raise ValueError(f"{settings.batch} requests cannot hold {settings.usage:.0%} of {settings.blocks:,} blocks "
                         f"over {settings.steps} steps: more blocks, fewer steps or a smaller batch")
    phased = decoding_engine(settings.blocks, settings.batch, context, max_tokens, settings.seed, shared_share=0,
                             prompt_tail=None)
    return WindowedEngine(phased.engine, settings.frames)


def headless_rate(engine: WindowedEngine, steps: int) -> tuple[int, float]:
    """(steps, process CPU seconds): the engine stepped from a thread of its own, as the app's worker does."""
    def run() -> None:
        for _ in range(steps):
            engine.step()

    cpu = time.process_time()
    thread = threading.Thread(target=run, name="bench-engine")
    thread.start()
    thread.join()
    return steps, time.process_time() - cpu


def time_frames(block_map, snapshots: list[CacheSnapshot]) -> tuple[list[int], list[int]]:
    """(cells, whole frame) thread CPU nanoseconds per snapshot: show_snapshot, then every line rendered."""
    cells, frames = [], []
    for snapshot in snapshots:
        start = time.thread_time_ns()
        block_map.show_snapshot(snapshot)
        shown = time.thread_time_ns()
        for y in range(block_map.size.height):
            block_map.render_line(y)
        end = time.thread_time_ns()
        cells.append(shown - start)
        frames.append(end - start)
    return cells, frames


async def window_run(engine: WindowedEngine, settings: UiSettings) -> dict:
    """The real app open on ``engine`` for ``settings.steps`` steps, then the frame timing on its block map."""
    from kvscope.app.screens.main import MainScreen

    paints: list[int] = []
    paint = MainScreen.paint
    measuring = []     # the engine, once the window runs it: the paints of its measured steps are timed

    def timed_paint(screen, force: bool = False) -> None:
        start = time.thread_time_ns()
        paint(screen, force)
        if measuring and measuring[0].measuring:
            paints.append(time.thread_time_ns() - start)

    MainScreen.paint = timed_paint   # before the screen mounts, whose timer binds the method
    try:
        measuring.append(engine)
        return await _window_run(engine, settings, paints)
    finally:
        MainScreen.paint = paint


async def _window_run(engine: WindowedEngine, settings: UiSettings, paints: list[int]) -> dict:
    from kvscope.app.app import KVScopeApp
    from kvscope.app.headless import wait_until
    from kvscope.app.worker.commands import SetPaused

    app = KVScopeApp(engine.config, log_enabled=False, engine_factory=lambda _config, _previous=None: engine,
                     paused=True)
    async with app.run_test(size=settings.size) as pilot:
        if not await wait_until(pilot, lambda: app.main.engine_info is not None, 120):
            raise RuntimeError("the app did not take the engine within 120 s")
        block_map = app.main.view.block_map
        painted = []
        show_snapshot = block_map.show_snapshot

        def counted(snapshot) -> None:
            if engine.measuring:
                painted.append(1)
            show_snapshot(snapshot)

        block_map.show_snapshot = counted
        first = len(engine.stats) + settings.steps
        engine.measure(settings.steps, settings.steps)     # as many steps of warm-up as measured
        app.worker.send(SetPaused(False))
        if not await wait_until(pilot, lambda: engine.stopped is not None, 3600):
            raise RuntimeError("the engine stopped stepping in the window")
        frames, (cpu, ui_cpu), (stopped_cpu, stopped_ui, usage) = len(painted), engine.started, engine.stopped
        longest_paint = max(paints, default=0) / 1e6
        app.worker.send(SetPaused(True))
        await wait_until(pilot, lambda: app.worker.state.paused, 30)
        block_map.show_snapshot = show_snapshot
        cells, frame = time_frames(block_map, list(engine.recent))
        layout = block_map.map_layout
        return {"usage": usage, "steps": settings.steps, "cpu": stopped_cpu - cpu, "painted": frames,
                "longest_paint_ms": longest_paint,
                "engine_ms": engine.engine_ms(first, first + settings.steps),
                "ui_ms": (stopped_ui - ui_cpu) / settings.steps / 1e6,
                "cells": cells, "frame": frame, "num_cells": layout.num_cells,
                "blocks_per_cell": layout.blocks_per_cell}


def run_ui_bench(settings: UiSettings, progress=None) -> UiResult:
    from kvscope.app.bench.ui_process import process_sides
    from kvscope.app.bench.ui_run_log import measure_log_cost

    say = progress or (lambda line: None)
    say(f"filling {settings.usage:.0%} of {settings.blocks:,} blocks with {settings.batch} requests, twice")
    # Both engines are built before either side runs: an engine built after another was freed stepped 2-4%
    # slower on this machine (the heap it lands in), and that drift would be charged to the window.
    engine, twin = full_engine(settings), full_engine(settings)
    say(f"headless, {settings.steps} steps after as many unmeasured")
    # The window keeps its own and its engine's long-lived objects out of the cyclic collector's walks
    # (MainScreen.engine_ready); the headless side gets the same, so the window's cost is the window's alone.
    gc.freeze()
    try:
        headless_rate(engine, settings.steps)     # the warm-up the window gets
        first = len(engine.stats)
        before = headless_rate(engine, settings.steps)
    finally:
        gc.unfreeze()
    headless_engine_ms = engine.engine_ms(first, first + settings.steps)
    del engine
    say(f"the window open at {settings.size[0]}x{settings.size[1]} on a twin engine, {settings.steps} steps")
    window = asyncio.run(window_run(twin, settings))
    del twin
    process = process_sides(settings, say)
    say(f"the run log: one engine alone and recording, {settings.steps} steps a side")
    run_log = measure_log_cost(settings)
    return UiResult(
        settings=settings, usage=window["usage"],
        cells=window["num_cells"], blocks_per_cell=window["blocks_per_cell"],
        frame=Spread.of(window["frame"]), cells_ms=Spread.of(window["cells"]),
        headless_steps_per_cpu_s=before[0] / before[1],
        window_steps_per_cpu_s=window["steps"] / window["cpu"], window_frames=window["painted"],
        longest_paint_ms=window["longest_paint_ms"],
        headless_engine_ms=headless_engine_ms, window_engine_ms=window["engine_ms"], window_ui_ms=window["ui_ms"],
        process_headless_steps_per_cpu_s=process["headless_steps_per_cpu_s"],
        process_window_steps_per_cpu_s=process["window_steps_per_cpu_s"],
        process_headless_engine_ms=process["headless_engine_ms"],
        process_window_engine_ms=process["window_engine_ms"], process_ui_ms=process["ui_ms"],
        process_headless_steps_per_s=process["headless_steps_per_s"],
        process_window_steps_per_s=process["window_steps_per_s"], process_turn_costs=tuple(process["turn_costs"]),
        process_posts_per_s=process["posts_per_s"], process_steps_per_post=process["steps_per_post"],
        run_log=run_log)


def format_table(result: UiResult) -> str:
    from kvscope.app.screens.main import FRAME_RATE
    from kvscope.app.worker.step_posting import POST_SHARE, STEPS_POST_INTERVAL

    s = result.settings

    def ms(spread: Spread) -> str:
        return f"{spread.median:.1f} ms ({spread.p10:.1f}-{spread.p90:.1f})"

    rows = [
        ("pool", f"{s.blocks:,} blocks, {result.usage:.0%} in use, {s.batch} requests decoding (FakeRunner)"),
        ("block map", f"{result.cells:,} cells of {result.blocks_per_cell:,} blocks, window {s.size[0]}x{s.size[1]}"),
        ("frame: cells from the snapshot", ms(result.cells_ms)),
        ("frame: cells and every line", ms(result.frame)),
        ("engine headless", f"{result.headless_steps_per_cpu_s:,.1f} steps per CPU second"),
        ("engine, window open", f"{result.window_steps_per_cpu_s:,.1f} steps per CPU second, --in-process "
                                f"({result.window_frames} frames painted in {s.steps} steps)"),
        ("longest paint", f"{result.longest_paint_ms:.1f} ms of UI-thread CPU at once (a frame at "
                          f"{FRAME_RATE} a second is {1000 / FRAME_RATE:.0f} ms)"),
        ("the window's cost", f"{100 * result.window_cost:.1f}% of engine throughput"),
        ("  engine thread per step", f"{result.headless_engine_ms:.2f} ms headless, {result.window_engine_ms:.2f} ms "
                                     "with the window open"),
        ("  UI thread per engine step", f"{result.window_ui_ms:.2f} ms"),
        ("engine in its own process", "kvscope's default; CPU of the engine's process, "
                                      f"{s.rounds} segments a side, alternated"),
        ("  engine alone", f"{result.process_headless_steps_per_cpu_s:,.1f} steps per CPU second"),
        ("  window open", f"{result.process_window_steps_per_cpu_s:,.1f} steps per CPU second"),
        ("  the window's cost", f"{100 * result.process_window_cost:.1f}% of engine throughput (turn by turn: "
                                + ", ".join(f"{100 * cost:.1f}%" for cost in result.process_turn_costs) + ")"),
        ("  engine thread per step", f"{result.process_headless_engine_ms:.2f} ms alone, "
                                     f"{result.process_window_engine_ms:.2f} ms with the window open"),
        ("  window's process per engine step", f"{result.process_ui_ms:.2f} ms, on another core"),
        ("  posts to the window", f"{result.process_posts_per_s:.1f} a second of {result.process_steps_per_post:.0f} "
                                  f"steps each (at most {1 / STEPS_POST_INTERVAL:.0f} a second, spaced so they take "
                                  f"at most {POST_SHARE:.0%} of the engine's time)"),
        ("  steps per wall-clock second", f"{result.process_headless_steps_per_s:,.1f} alone, "
                                          f"{result.process_window_steps_per_s:,.1f} with the window open"),
        *result.run_log.rows(s.rounds),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["kvscope bench ui: frame times in UI-thread CPU, median (p10-p90) over "
                      f"{s.frames} frames; throughput in process CPU, {s.steps} steps a side"]
                     + [f"  {name:<{width}}  {value}" for name, value in rows])


def as_json(result: UiResult) -> dict:
    return {"bench": "ui", "blocks": result.settings.blocks, "usage": result.usage, "batch": result.settings.batch,
            "cells": result.cells, "blocks_per_cell": result.blocks_per_cell, "frame_ms": vars(result.frame),
            "cells_ms": vars(result.cells_ms), "headless_steps_per_cpu_s": result.headless_steps_per_cpu_s,
            "window_steps_per_cpu_s": result.window_steps_per_cpu_s, "window_frames": result.window_frames,
            "longest_paint_ms": result.longest_paint_ms,
            "window_cost": result.window_cost, "headless_engine_ms": result.headless_engine_ms,
            "window_engine_ms": result.window_engine_ms, "window_ui_ms": result.window_ui_ms,
            "process_headless_steps_per_cpu_s": result.process_headless_steps_per_cpu_s,
            "process_window_steps_per_cpu_s": result.process_window_steps_per_cpu_s,
            "process_window_cost": result.process_window_cost,
            "process_headless_engine_ms": result.process_headless_engine_ms,
            "process_window_engine_ms": result.process_window_engine_ms, "process_ui_ms": result.process_ui_ms,
            "process_headless_steps_per_s": result.process_headless_steps_per_s,
            "process_window_steps_per_s": result.process_window_steps_per_s,
            "process_turn_costs": list(result.process_turn_costs),
            "process_posts_per_s": result.process_posts_per_s,
            "process_steps_per_post": result.process_steps_per_post, "run_log": result.run_log.as_json()}
