"""Shared pieces for the app tests (no tests here): fake engines, a fixed clock, fixed system figures.

Imported as a plain module (tests/ is on sys.path through conftest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

from kvscope.app.app import KVScopeApp
from kvscope.app.bench.ui import RecordingEngine
from kvscope.app.headless import wait_until
from kvscope.app.screens.history import HistoryScreen
from kvscope.app.widgets.system import SystemSample
from kvscope.app.worker.commands import LaunchPreset
from kvscope.engine.config import EngineConfig
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.kv_cache_groups import group_layers
from kvscope.engine.model.loader import ModelError

STEP_SECONDS = 0.02
# A fake engine's layers for a config naming a model offered by name, so a lesson that runs on one plays on fakes:
# Gemma 3 270M's 18 layers, five of 512-token windows per full one.
MODEL_GROUPS = {"gemma3-270m": group_layers(([512] * 5 + [None]) * 3)}


def replace(record, **changes):
    """A copy of an engine record with some fields changed, whether the record is a dataclass or a
    NamedTuple (engine/outputs.py may move its types from one to the other)."""
    if hasattr(record, "_replace"):
        return record._replace(**changes)
    return dataclasses.replace(record, **changes)


class FixedClockEngine(RecordingEngine):
    """Every step reports the same duration, so rates and latencies drawn on screen are reproducible."""

    def step(self):
        result = self._engine.step()
        stats = result.stats
        stats = replace(
            stats, time=1_700_000_000 + stats.step * STEP_SECONDS, duration=STEP_SECONDS,
            forward_duration=STEP_SECONDS / 2, prompt_tokens_per_s=stats.num_prefill_tokens / STEP_SECONDS,
            generation_tokens_per_s=stats.num_decode_tokens / STEP_SECONDS)
        result = replace(result, stats=stats)
        self.stats.append(stats)
        self.num_finished += sum(output.finished for output in result.outputs)
        return result


class FixedSampler:
    def sample(self) -> SystemSample:
        return SystemSample(cpu_percent=42.0, ram_used=6 * 2**30, ram_total=16 * 2**30,
                            process_rss=300 * 2**20, gpus=(), gpu_note="no NVIDIA GPU: GPU figures off")


class FakeEngines:
    """Engine factory for the app: FakeRunner engines, each wrapped so the test can read every step."""

    def __init__(self, *, fixed_clock: bool = False, fail_steps: int = 0, **runner_kwargs) -> None:
        self.runner_kwargs = {"num_host_blocks": 32, **runner_kwargs}
        self.fixed_clock = fixed_clock
        self.fail_steps = fail_steps
        self.fail_builds = 0    # the next this many builds raise, as a bad model path does
        self.built: list[RecordingEngine] = []

    def __call__(self, config: EngineConfig, previous=None):
        if self.fail_builds:
            self.fail_builds -= 1
            raise ModelError(f"model path {config.model} does not exist; check the path")
        wrapper = FixedClockEngine if self.fixed_clock else RecordingEngine
        shape = {"kv_cache_groups": MODEL_GROUPS.get(config.model, ())}
        engine = wrapper(fake_engine(config, **(shape | self.runner_kwargs)))
        if self.fail_steps:
            engine = FailingEngine(engine, self.fail_steps)
        self.built.append(engine)
        return engine

    @property
    def engine(self):
        return self.built[-1]


class FailingEngine(RecordingEngine):
    """The first ``failures`` steps raise, as an engine bug would."""

    def __init__(self, engine, failures: int) -> None:
        super().__init__(engine)
        self.failures = failures

    def step(self):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("simulated engine bug")
        return self._engine.step()


def make_app(engines: FakeEngines | None = None, *, config: EngineConfig | None = None,
             **kwargs) -> KVScopeApp:
    config = config or EngineConfig(block_size=16, num_blocks=128, max_model_len=512)
    kwargs.setdefault("log_enabled", False)
    kwargs.setdefault("paused", True)
    kwargs.setdefault("system_sampler", FixedSampler())
    kwargs.setdefault("fetch_hint", lambda model: None)     # fake engines load no model: every one is there
    return KVScopeApp(config, engine_factory=engines or FakeEngines(), **kwargs)


@contextlib.asynccontextmanager
async def window(size: tuple[int, int] = (160, 48), engines: FakeEngines | None = None, **kwargs):
    """The window on a fake engine, opened at ``size`` and started: ``async with window() as (app, pilot)``."""
    app = make_app(engines or FakeEngines(), **kwargs)
    async with app.run_test(size=size) as pilot:
        await started(pilot)
        yield app, pilot


async def until(pilot, condition, timeout: float = 15.0) -> None:
    assert await wait_until(pilot, condition, timeout, poll=0.01), "the app did not get there in time"


async def started(pilot) -> None:
    await until(pilot, lambda: pilot.app.main.engine_info is not None)


async def history_on(pilot, run_id: int, num_runs: int):
    """F9, then History's cursor on run ``run_id`` once ``num_runs`` runs are listed: the History screen."""
    await pilot.press("f9")
    history = pilot.app.screen
    assert isinstance(history, HistoryScreen)
    runs = history.query_one("#runs")
    await until(pilot, lambda: runs.row_count == num_runs)
    runs.move_cursor(row=runs.get_row_index(str(run_id)))
    await until(pilot, lambda: history.run_id == run_id)
    return history


def step_number(app) -> int:
    return app.main.latest.stats.step if app.main.latest else 0


async def single_steps(pilot, count: int) -> None:
    """Press F3 ``count`` times, each time waiting for that step to reach the UI."""
    app = pilot.app
    for _ in range(count):
        target = step_number(app) + 1
        await pilot.press("f3")
        await until(pilot, lambda target=target: step_number(app) >= target)
    app.main.paint(force=True)
    await pilot.pause()


async def burst_steps(pilot, num_requests: int, steps: int) -> None:
    """Launch the burst preset with ``num_requests`` chat prompts, then single-step ``steps`` times."""
    pilot.app.worker.send(LaunchPreset("burst", num_requests))
    await single_steps(pilot, steps)


async def shared_and_burst_on_a_focused_map(pilot, num_requests: int):
    """Three requests sharing a system prompt, then a burst of ``num_requests`` chat prompts over 10 steps; the
    map drawn and focused. Returns the map."""
    app = pilot.app
    await started(pilot)    # the snapshot tests hand over a window that has not started yet
    app.worker.send(LaunchPreset("shared", 3))
    await burst_steps(pilot, num_requests, 10)
    app.main.paint(force=True)
    block_map = app.main.view.block_map
    block_map.focus()
    await pilot.pause()
    return block_map


async def type_chat(pilot, text: str) -> None:
    chat_input = pilot.app.main.query_one("#chat-input")
    chat_input.focus()
    chat_input.value = text
    await pilot.press("enter")
