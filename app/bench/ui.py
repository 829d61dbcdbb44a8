"""`kvscope bench ui`: what the open window costs the engine, and how fast the block map paints.

1. Engine throughput on one workload, run headless and with the app open
   (headless Textual through ``run_test``), in one process on the same weights,
   the engine stepped from a worker thread both times, in alternating rounds.
   Throughput is generated tokens over the engine's own busy span, first step's
   start to last step's end.
2. The block map's full repaint for a 4096-block pool with 256 requests: a new
   snapshot in which every cell changed, turned into codes and every line
   rendered through Textual's styles cache. Median over many repaints.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import numpy as np

from kvscope.app.worker.commands import AddRequest, SetPaused
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.outputs import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED, CacheSnapshot, RequestView, StepStats

MAP_SIZE = (130, 40)   # window for the map bench: a 4096-block pool fits one block per cell


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


def generation_rate(stats: list[StepStats]) -> float:
    """Generated tokens per second of engine time span (first step start to last step end)."""
    busy = [s for s in stats if s.num_prefill_tokens or s.num_decode_tokens]
    if not busy:
        return 0.0
    span = busy[-1].time - (busy[0].time - busy[0].duration)
    generated = sum(s.generation_tokens_per_s * s.duration for s in busy)
    return generated / span if span > 0 else 0.0


def _workload(num_requests: int, max_tokens: int) -> list[tuple[list[dict], SamplingParams]]:
    from kvscope.app.load.presets import prompt_lines

    questions = prompt_lines("chat_questions.txt")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [([{"role": "user", "content": questions[i % len(questions)]}], params)
            for i in range(num_requests)]


def _headless(make_engine, workload) -> float:
    """The workload on a bare engine, stepped from a thread of its own as the app's engine thread is
    (torch's CPU thread pool behaves differently in the main thread, so this keeps the comparison fair)."""
    engine = RecordingEngine(make_engine())
    for i, (prompt, params) in enumerate(workload):
        engine.add_request(prompt, params, request_id=f"bench-{i}")

    def run() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    thread = threading.Thread(target=run, name="bench-engine")
    thread.start()
    thread.join()
    return generation_rate(engine.stats)


async def _with_ui(make_engine, workload, config: EngineConfig, size: tuple[int, int]) -> float:
    from kvscope.app.app import KVScopeApp
    from kvscope.app.headless import wait_until

    recording: list[RecordingEngine] = []

    def factory(_config, _previous=None):
        recording.append(RecordingEngine(make_engine()))
        return recording[-1]

    app = KVScopeApp(config, log_enabled=False, engine_factory=factory, paused=True)
    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, lambda: app.main.engine_info is not None, 120)
        for i, (prompt, params) in enumerate(workload):
            app.worker.send(AddRequest(f"bench-{i}", prompt, params))
        app.worker.send(SetPaused(False))
        await wait_until(pilot, lambda: recording[0].num_finished == len(workload), 3600)
    return generation_rate(recording[0].stats)


def bench_engine_with_ui(config: EngineConfig, num_requests: int = 32, max_tokens: int = 64,
                         repeats: int = 3, size: tuple[int, int] = (160, 48)) -> dict:
    """Rounds of one headless run and one with the UI, the order swapped every other round, so a machine
    that gets busier or quieter during the bench weighs on both sides alike; medians over the rounds."""
    from kvscope.app.worker.factory import build_engine

    first = build_engine(config)

    def make_engine():
        return build_engine(config, first)

    workload = _workload(num_requests, max_tokens)
    _headless(make_engine, _workload(4, 8))  # warm-up: first forwards allocate and compile
    sides = {"headless": lambda: _headless(make_engine, workload),
             "ui": lambda: asyncio.run(_with_ui(make_engine, workload, config, size))}
    rounds = []
    for index in range(repeats):
        order = ("headless", "ui") if index % 2 == 0 else ("ui", "headless")
        rates = {side: sides[side]() for side in order}
        rounds.append((rates["headless"], rates["ui"]))
    headless = statistics.median(h for h, _ in rounds)
    with_ui = statistics.median(u for _, u in rounds)
    return {"headless_tok_s": headless, "ui_tok_s": with_ui, "ratio": with_ui / headless,
            "rounds": rounds, "num_requests": num_requests, "max_tokens": max_tokens, "repeats": repeats,
            "model": first.info.model_name}


# --- block map ---------------------------------------------------------------------------------------


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


async def _map_repaints(snapshots: list[CacheSnapshot], repaints: int,
                        size: tuple[int, int]) -> tuple[list[float], list[float]]:
    """(widget, full) seconds per repaint: the map's own work (snapshot to cell codes to one Strip per
    line), and that plus Textual's per-line pass (background, borders, colour filter)."""
    from textual.app import App, ComposeResult
    from textual.geometry import Region

    from kvscope.app.widgets.block_map import BlockMap
    from kvscope.themes import BLOCK_VARIABLE_DEFAULTS, THEMES

    class MapApp(App):
        def get_theme_variable_defaults(self) -> dict[str, str]:
            return BLOCK_VARIABLE_DEFAULTS

        def compose(self) -> ComposeResult:
            yield BlockMap()

    app = MapApp()
    widget, full = [], []
    async with app.run_test(size=size) as pilot:
        for theme in THEMES:
            app.register_theme(theme)
        app.theme = THEMES[0].name
        await pilot.pause()
        block_map = app.query_one(BlockMap)
        region = Region(0, 0, *block_map.outer_size)
        for i in range(repaints):
            start = time.perf_counter()
            block_map.show_snapshot(snapshots[i % len(snapshots)])
            for y in range(block_map.size.height):
                block_map.render_line(y)
            drawn = time.perf_counter()
            block_map.refresh()     # every line through Textual's pass, as in a full repaint
            block_map.render_lines(region)
            widget.append(drawn - start)
            full.append(time.perf_counter() - start)
    return widget, full


def bench_block_map(num_blocks: int = 4096, num_requests: int = 256, repaints: int = 60,
                    size: tuple[int, int] = MAP_SIZE) -> dict:
    # Consecutive snapshots differ in every cell, so each repaint redraws every line.
    snapshots = [synthetic_snapshot(num_blocks, num_requests, seed=seed) for seed in range(4)]
    widget, full = asyncio.run(_map_repaints(snapshots, repaints, size))
    return {"num_blocks": num_blocks, "num_requests": num_requests, "repaints": repaints,
            "widget_median_ms": 1000 * statistics.median(widget),
            "median_ms": 1000 * statistics.median(full),
            "p90_ms": 1000 * float(np.percentile(full, 90))}


def run_ui_bench(config: EngineConfig | None = None, *, num_requests: int = 32, max_tokens: int = 64,
                 repeats: int = 3, engine: bool = True) -> dict:
    """Both figures; ``engine=False`` skips the model run (only the block-map figure)."""
    result = {"block_map": bench_block_map()}
    block_map = result["block_map"]
    print(f"block map, {block_map['num_blocks']} blocks, {block_map['num_requests']} requests, full repaint: "
          f"median {block_map['median_ms']:.2f} ms (p90 {block_map['p90_ms']:.2f} ms), of which the map's "
          f"own work {block_map['widget_median_ms']:.2f} ms and Textual's line pass the rest")
    if engine:
        run = bench_engine_with_ui(config or EngineConfig(), num_requests, max_tokens, repeats)
        result["engine"] = run
        print(f"engine ({run['model']}, {num_requests} requests x {max_tokens} tokens): "
              f"headless {run['headless_tok_s']:.1f} tok/s, with the UI open {run['ui_tok_s']:.1f} tok/s "
              f"= {100 * run['ratio']:.1f}% of headless (medians of {repeats} rounds: "
              + ", ".join(f"{h:.1f}/{u:.1f}" for h, u in run["rounds"]) + ")")
    return result
