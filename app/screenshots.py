"""`kvscope screenshots`: regenerate screenshots/ from the real app, driven headless under real load.

Each scene starts a fresh app (so its run is clean) on the same loaded weights,
drives it the way a user would (presets, chat, pause and step), waits for the
situation it wants to show, and saves an SVG with Textual's own exporter.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

from kvscope.app.headless import wait_until
from kvscope.app.worker.commands import LaunchPreset, SetPaused, StepOnce
from kvscope.engine.config import EngineConfig

DEFAULT_SIZE = (160, 48)
SCENE_TIMEOUT_S = 600.0
CHAT_MAX_TOKENS = 64


class SharedWeights:
    """An engine factory that loads the model once and hands its weights to every later engine."""

    def __init__(self) -> None:
        self.first = None

    def __call__(self, config: EngineConfig, previous=None):
        from kvscope.app.worker.factory import build_engine

        engine = build_engine(config, previous or self.first)
        self.first = self.first or engine
        return engine


def _stats(app):
    """The newest step's stats, or None before the first step."""
    return app.main.latest.stats if app.main.latest else None


def _step(app) -> int:
    stats = _stats(app)
    return stats.step if stats else -1


async def _require(pilot, condition: Callable[[], bool], what: str) -> None:
    if not await wait_until(pilot, condition, SCENE_TIMEOUT_S, poll=0.01):
        raise RuntimeError(f"screenshot scene stuck: {what} did not happen within {SCENE_TIMEOUT_S:.0f} s")


async def _ready(pilot) -> None:
    await _require(pilot, lambda: pilot.app.main.engine_info is not None, "the engine start")


async def step_through(pilot, count: int) -> None:
    """Single-step the (paused) engine ``count`` times, each step drawn before the next."""
    app = pilot.app
    for _ in range(count):
        target = _step(app) + 1
        app.worker.send(StepOnce())
        await _require(pilot, lambda target=target: _step(app) >= target, f"step {target}")


async def _scene_main(pilot) -> None:
    """A shared system prompt plus a chat burst; one request selected, the cursor on a shared block."""
    app = pilot.app
    await _ready(pilot)
    app.worker.send(LaunchPreset("shared", 10))
    app.worker.send(LaunchPreset("burst", 10))
    await step_through(pilot, 24)
    app.main.paint(force=True)
    _select_shared(app)


async def _scene_chat(pilot) -> None:
    """Two chat turns: the second reply streams while its prompt's blocks come from the prefix cache."""
    app = pilot.app
    await _ready(pilot)
    await _ask(pilot, "What is a KV cache, in two sentences?")
    app.worker.send(SetPaused(False))
    await _require(pilot, lambda: app.main.chat.current_request is None, "the first reply")
    app.worker.send(SetPaused(True))
    await _ask(pilot, "And why does paging it help?")
    await step_through(pilot, 24)


async def _scene_overload(pilot) -> None:
    """More demand than a small pool holds, in swap mode: preempted, swapped and waiting requests."""
    app = pilot.app
    await _ready(pilot)
    app.worker.send(LaunchPreset("overload", 8))
    app.worker.send(SetPaused(False))
    await _require(pilot, lambda: _step(app) >= 0 and _stats(app).num_preemptions >= 3, "three preemptions")
    app.worker.send(SetPaused(True))


async def _scene_contiguous(pilot) -> None:
    """The contiguous allocator: whole max_model_len rows per request, most of them empty."""
    await _ready(pilot)
    pilot.app.worker.send(LaunchPreset("burst", 16))
    await step_through(pilot, 16)


def _scene_lesson(name: str, beat: int):
    """A lesson on the teaching pool, stopped at one of its beats."""
    async def scene(pilot) -> None:
        from kvscope.app.lessons.play import play

        await _ready(pilot)
        await play(pilot, name, stop_at=beat, beat_timeout=SCENE_TIMEOUT_S)
        pilot.app.lesson_screen.panel.focus()   # the map's cursor would cover a block

    return scene


def _select_shared(app) -> None:
    """Select the request with the most blocks and put the map's cursor on a shared block."""
    snapshot = app.main.latest.snapshot
    views = sorted(snapshot.requests, key=lambda v: -sum(len(t) for t in v.block_tables))
    if views:
        app.main.view.select_request(views[0].request_id)
    shared = [b for b in range(snapshot.num_blocks) if snapshot.ref_counts[b] > 1]
    if shared:
        app.main.view.block_map.focus()
        app.main.view.block_map.move_cursor_to_block(shared[0])


async def _ask(pilot, text: str) -> None:
    chat_input = pilot.app.main.query_one("#chat-input")
    chat_input.focus()
    chat_input.value = text
    await pilot.press("enter")


SCENES = {
    "main": (_scene_main, {}),
    "chat": (_scene_chat, {}),
    "overload": (_scene_overload, {"num_blocks": 48, "preemption_mode": "swap", "max_model_len": 1024,
                                   "swap_space": "64MiB"}),
    "paged-vs-contiguous": (_scene_contiguous, {"allocator": "contiguous", "num_blocks": 1024,
                                                "max_model_len": 2048}),
    "lesson-fragmentation": (_scene_lesson("fragmentation", 0), {}),
    "lesson-prefix-sharing": (_scene_lesson("prefix-sharing", 1), {}),
    "lesson-latency": (_scene_lesson("latency", 3), {}),
    "lesson-throughput": (_scene_lesson("throughput", 2), {}),
    "lesson-sizing": (_scene_lesson("sizing", 1), {}),
}


async def _shoot(name: str, config: EngineConfig, factory: Callable, out: Path,
                 size: tuple[int, int]) -> Path:
    from kvscope.app.app import KVScopeApp

    scene, changes = SCENES[name]
    app = KVScopeApp(dataclasses.replace(config, **changes), log_enabled=False, engine_factory=factory,
                     paused=True, chat_max_tokens=CHAT_MAX_TOKENS)
    async with app.run_test(size=size) as pilot:
        await scene(pilot)
        await _require(pilot, lambda: app.worker.state.paused, "the pause")
        await pilot.pause(0.3)   # let the last steps in flight arrive
        app.main.paint(force=True)
        app.clear_notifications()
        await pilot.pause(0.2)
        path = out / f"{name}.svg"
        app.save_screenshot(path.name, str(out))
    return path


def take_screenshots(config: EngineConfig, out: Path, size: tuple[int, int] = DEFAULT_SIZE,
                     scenes: list[str] | None = None, engine_factory: Callable | None = None) -> list[Path]:
    """One SVG per scene; ``engine_factory`` (config, previous) -> engine defaults to shared real weights."""
    out.mkdir(parents=True, exist_ok=True)
    factory = engine_factory or SharedWeights()
    return [asyncio.run(_shoot(name, config, factory, out, size)) for name in scenes or list(SCENES)]


def _size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    return int(width), int(height)


def _run(args: argparse.Namespace) -> int:
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, num_blocks=args.num_blocks,
                          max_model_len=args.max_model_len)
    for path in take_screenshots(config, Path(args.out), _size(args.size), args.scene):
        print(f"wrote {path}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("screenshots", help="regenerate screenshots/ from the real app under load")
    parser.add_argument("--out", default="screenshots", help="directory for the SVG files")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--num-blocks", type=int, default=768, help="pool size of the main and chat scenes")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--size", default=f"{DEFAULT_SIZE[0]}x{DEFAULT_SIZE[1]}", help="window size, WxH")
    parser.add_argument("--scene", action="append", choices=list(SCENES),
                        help="only this scene (repeatable); default: all")
    parser.set_defaults(func=_run)
