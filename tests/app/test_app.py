"""The live app, driven with Pilot: chat, presets, teaching controls, block inspection, errors."""

from __future__ import annotations

import pytest
from app_harness import FakeEngines, burst_steps, make_app, single_steps, started, step_number, type_chat, until, window

from kvscope.app.actions import ACTIONS
from kvscope.app.widgets import block_cells as cells
from kvscope.app.widgets.block_inspector import BlockInspector
from kvscope.app.widgets.block_map import BlockMap
from kvscope.app.widgets.block_table import BlockTable
from kvscope.app.widgets.chat import ChatPane
from kvscope.app.widgets.counters import Counters, describe_stats
from kvscope.app.widgets.header import EngineHeader
from kvscope.app.widgets.queues import QueuesTable
from kvscope.app.worker.commands import LaunchPreset
from kvscope.engine.config import EngineConfig

pytestmark = pytest.mark.anyio


def _reply(app) -> str:
    bubbles = app.main.query(".bubble.assistant")
    return str(bubbles.last().render()) if bubbles else ""


async def test_input_has_focus_at_start_and_chat_streams_a_reply():
    engines = FakeEngines()
    app = make_app(engines, chat_max_tokens=24)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        assert app.focused is app.main.query_one("#chat-input")
        await type_chat(pilot, "Why is the sky blue?")
        chat = app.main.query_one(ChatPane)
        request_id = chat.current_request
        assert request_id == "chat-1"
        await single_steps(pilot, 3)   # prefill, then two decode steps: the reply is part-way
        partial = _reply(app)
        assert 0 < len(partial) < 24
        assert app.main.query_one(BlockMap).chat_request == request_id
        await pilot.press("f2")        # resume: the rest streams in
        await until(pilot, lambda: chat.current_request is None)
        final = _reply(app)
        assert final.startswith(partial)
        assert len(final) > len(partial)
        assert chat.messages[-1]["role"] == "assistant"
        assert final.startswith(chat.messages[-1]["content"])


async def test_second_chat_turn_reuses_the_first_turns_blocks():
    engines = FakeEngines()
    app = make_app(engines, chat_max_tokens=12, paused=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        chat = app.main.query_one(ChatPane)
        await type_chat(pilot, "First question, long enough to fill a couple of blocks of sixteen tokens.")
        await until(pilot, lambda: chat.current_request is None)
        await pilot.press("f2")        # pause so the second turn's first step can be inspected
        await until(pilot, lambda: app.worker.state.paused)
        await type_chat(pilot, "And a follow-up?")
        await single_steps(pilot, 1)
        view = next(v for v in app.main.latest.snapshot.requests if v.request_id == "chat-2")
        assert view.num_cached_tokens >= 3 * 16   # the whole first turn, block-aligned, came from the cache
        assert app.main.latest.stats.prefix_cache_hits >= view.num_cached_tokens


async def test_load_preset_fills_the_queues_and_counters_match_the_engine():
    engines = FakeEngines()
    app = make_app(engines)
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        app.main.query_one("#preset-count").value = "6"
        await pilot.press("f6")
        await single_steps(pilot, 2)
        table = app.main.query_one(QueuesTable)
        live = [v.request_id for v in app.main.latest.snapshot.requests]
        assert len(live) == 6
        assert set(table.rows) == set(live)
        assert table.order == live      # running first, in arrival order
        engine_stats = engines.engine.stats[-1]
        counters = app.main.query_one(Counters)
        assert counters.stats == engine_stats
        shown = str(counters.render())
        assert str(counters.render()) == str(counters.render())  # rendering is pure
        assert f"{engine_stats.num_free_blocks:,} / {engine_stats.num_total_blocks:,}" in shown
        assert f"{100 * engine_stats.kv_usage:5.1f}%" in shown
        assert describe_stats(engine_stats).count("\n") == shown.count("\n")
        assert table.border_title == f"Queues · running {engine_stats.num_running} · swapped 0 · waiting " \
                                     f"{engine_stats.num_waiting}"


async def test_pause_and_single_step_advance_exactly_one_step():
    engines = FakeEngines()
    app = make_app(engines, paused=False, steps_per_s_cap=50)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        app.worker.send(LaunchPreset("burst", 4))
        await until(pilot, lambda: step_number(app) >= 3)
        await pilot.press("f2")
        await until(pilot, lambda: app.worker.state.paused)
        await pilot.pause(0.2)
        before = len(engines.engine.stats)
        await pilot.press("f3")
        await until(pilot, lambda: len(engines.engine.stats) == before + 1)
        await pilot.pause(0.3)
        assert len(engines.engine.stats) == before + 1
        assert "paused" in str(app.main.query_one(EngineHeader).render())


async def test_selecting_a_block_shows_its_owner():
    async with window((160, 48)) as (app, pilot):
        await burst_steps(pilot, 3, 2)
        snapshot = app.main.latest.snapshot
        owner = snapshot.requests[1]
        block = owner.block_tables[0][0]
        block_map = app.main.query_one(BlockMap)
        layout = block_map.map_layout
        cell = block // layout.blocks_per_cell
        x, y = (cell % layout.columns) * layout.cell_width, cell // layout.columns
        gutter = block_map.styles.gutter
        await pilot.click(block_map, offset=(gutter.left + x, gutter.top + y))
        await pilot.pause()
        inspector = str(app.main.query_one(BlockInspector).render())
        assert f"Block {block}" in inspector
        assert f"{owner.request_id} logical 0" in inspector
        assert block_map.selected_request == owner.request_id
        assert owner.request_id in str(app.main.query_one(BlockTable).render())
        selected = block_map._codes // cells.GLYPH_SLOTS // cells.NUM_BASE_STYLES
        assert selected[cell] in (cells.OVERLAY_SELECTED, cells.OVERLAY_CURSOR)


async def test_an_over_long_prompt_shows_an_error_and_the_app_keeps_working():
    engines = FakeEngines()
    app = make_app(engines, config=EngineConfig(num_blocks=128, max_model_len=256), chat_max_tokens=8,
                   paused=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        chat = app.main.query_one(ChatPane)
        await type_chat(pilot, "word " * 100)
        await until(pilot, lambda: chat.current_request is None)
        error = app.main.query(".bubble.error")
        assert len(error) == 1
        assert "max_model_len" in str(error.first().render())
        await until(pilot, lambda: any(n.severity == "error" for n in app._notifications))   # gathered, then told
        assert chat.messages == []
        await type_chat(pilot, "short one")
        await until(pilot, lambda: chat.current_request is None)
        assert chat.messages[-1]["role"] == "assistant" and len(_reply(app)) > 0


async def test_an_engine_error_is_shown_and_resume_recovers():
    engines = FakeEngines(fail_steps=1)
    app = make_app(engines, paused=False, chat_max_tokens=6)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        chat = app.main.query_one(ChatPane)
        await type_chat(pilot, "hello")
        await until(pilot, lambda: app.worker.state.paused)
        assert any("simulated engine bug" in n.message for n in app._notifications)
        assert "paused" in str(app.main.query_one(EngineHeader).render())
        assert chat.current_request == "chat-1"      # the reply is still in the engine, waiting
        await pilot.press("f2")
        await until(pilot, lambda: chat.current_request is None)
        assert chat.messages[-1]["role"] == "assistant"


async def test_switching_preemption_and_prefix_caching_rebuilds_the_engine():
    engines = FakeEngines()
    app = make_app(engines)
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        await pilot.press("f7")
        await until(pilot, lambda: app.main.engine_info.config.preemption_mode == "swap")
        await pilot.press("f8")
        await until(pilot, lambda: not app.main.engine_info.config.enable_prefix_caching)
        assert len(engines.built) == 3
        header = str(app.main.query_one(EngineHeader).render())
        assert "preempt: swap" in header and "prefix cache off" in header


async def test_command_palette_lists_every_action_once():
    async with window((160, 48)) as (app, pilot):
        titles = [command.title.split(" (")[0] for command in app.get_system_commands(app.screen)]
        for action in ACTIONS:
            assert action.title in titles, action.title
        assert len(titles) == len(set(titles)), titles     # Textual's Theme and Screenshot are not repeated
        assert {"f1", "f2", "f3", "f10", "q"} <= {key for key, _ in app._bindings}


async def test_explain_screen_opens_and_closes():
    async with window((100, 30)) as (app, pilot):
        await pilot.press("f1")
        assert app.screen.__class__.__name__ == "ExplainScreen"
        await pilot.press("escape")
        assert app.screen is app.main


async def test_theme_switch_restyles_the_map():
    async with window((120, 36)) as (app, pilot):
        await burst_steps(pilot, 2, 1)
        block_map = app.main.query_one(BlockMap)
        dark = block_map._style(cells.STYLE_OWNER)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.theme == "kvscope-light"
        assert block_map._style(cells.STYLE_OWNER) != dark


async def test_80x24_and_resizing_keep_every_panel_reachable():
    async with window((80, 24)) as (app, pilot):
        assert app.screen.has_class("-narrow")
        assert app.main.query_one("#chat-input").region.bottom <= 24
        header = str(app.main.query_one(EngineHeader).render())
        assert "prefix✓" in header                              # the compact description
        assert header.index("paused") < header.index("128×16")   # the run state comes first
        await burst_steps(pilot, 2, 1)
        block_map = app.main.query_one(BlockMap)
        narrow = block_map.map_layout
        await pilot.resize_terminal(160, 48)
        await pilot.pause()
        assert app.screen.has_class("-wide")
        wide = block_map.map_layout
        assert wide.columns * wide.cell_width > narrow.columns * narrow.cell_width
        assert wide.num_blocks == narrow.num_blocks == 128
        assert "preempt: recompute" in str(app.main.query_one(EngineHeader).render())   # both full lines fit


async def test_a_narrow_queue_table_leaves_out_the_least_needed_columns():
    async with window((120, 36)) as (app, pilot):
        await burst_steps(pilot, 3, 1)
        table = app.main.query_one(QueuesTable)
        header = table.render_line(0).text.split()
        assert header[:2] == ["request", "queue"] and "output" in header and "preempt" in header
        assert "prompt" not in header and "cached" not in header
        await pilot.resize_terminal(200, 48)
        await pilot.pause()
        assert "prompt" in table.render_line(0).text.split()


async def test_ctrl_g_aborts_the_chat_reply_and_frees_its_blocks():
    engines = FakeEngines()
    app = make_app(engines, chat_max_tokens=200)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        await type_chat(pilot, "Tell me a long story")
        await single_steps(pilot, 3)
        await pilot.press("ctrl+g")
        chat = app.main.query_one(ChatPane)
        assert chat.current_request is None
        assert _reply(app).endswith("[aborted]")
        await pilot.press("f2")
        await until(pilot, lambda: app.main.latest.snapshot.requests == ())
        assert app.main.latest.stats.num_free_blocks == app.main.latest.stats.num_total_blocks


async def test_selecting_a_request_in_the_queues_highlights_its_blocks():
    async with window((160, 48)) as (app, pilot):
        await burst_steps(pilot, 3, 2)
        table = app.main.query_one(QueuesTable)
        chosen = table.order[1]
        gutter = table.styles.gutter
        await pilot.click(table, offset=(gutter.left + 2, gutter.top + 2))   # header, then rows 0, 1
        await pilot.pause()
        block_map = app.main.query_one(BlockMap)
        assert block_map.selected_request == chosen
        assert chosen in str(app.main.query_one(BlockTable).render())
        view = next(v for v in app.main.latest.snapshot.requests if v.request_id == chosen)
        overlays = block_map._codes // cells.GLYPH_SLOTS // cells.NUM_BASE_STYLES
        assert all(overlays[b] == cells.OVERLAY_SELECTED for b in view.block_tables[0])
        await pilot.press("down", "enter")
        await pilot.pause()
        assert block_map.selected_request == table.order[2]


@pytest.mark.parametrize("key", ["f7", "f8", "lesson"])
async def test_a_restart_or_a_lesson_with_requests_in_flight_asks_first_and_says_how_many_it_aborted(key):
    """Issue 25 defect 5: F7, F8 or a lesson dropped 24 requests without a word."""
    from kvscope.app.screens.quit import ConfirmAbort

    engines = FakeEngines()
    app = make_app(engines)
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        app.worker.send(LaunchPreset("overload", 24))
        await until(pilot, lambda: app.main.queued is not None and len(app.main.queued.requests) == 24)
        app.main.view.block_map.focus()

        async def ask():
            if key == "lesson":
                app.start_lesson("copy-on-write")
            else:
                await pilot.press(key)
            await pilot.pause()

        await ask()
        assert isinstance(app.screen, ConfirmAbort)
        assert "24 requests still in flight" in str(app.screen.query_one(".dialog-text").render())
        await pilot.press("n")                                      # keep them: nothing restarts
        await pilot.pause()
        assert app.screen is app.main and len(engines.built) == 1 and app.lesson_screen is None
        await ask()
        notices = []
        app.notify = lambda message, **kwargs: notices.append(message)
        await pilot.press("y")
        await until(pilot, lambda: len(engines.built) == 2)
        assert any("24 requests aborted" in notice for notice in notices), notices


async def test_a_restart_with_nothing_in_flight_asks_nothing():
    engines = FakeEngines()
    app = make_app(engines)
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        await pilot.press("f8")
        await until(pilot, lambda: len(engines.built) == 2)
        assert app.screen is app.main


async def test_the_palette_names_keys_as_the_footer_does_and_the_chat_says_how_it_samples():
    async with window((160, 48)) as (app, pilot):
        titles = [command.title for command in app.get_system_commands(app.screen)]
        assert "Keys (?)" in titles and "Explain (F1)" in titles and not any("question_mark" in t for t in titles)
        assert app.main.chat.border_subtitle == "greedy · generation_config"     # SmolLM2's, and the fake's
        legend = str(app.main.query_one("#legend").render())
        assert "shared by 2 (+ 10+)" in legend


async def test_the_map_keeps_one_scale_on_one_pool_whatever_the_lines_around_it_say():
    """Issue 25 defect 13: the map switched between 1 cell = 6 and 7 blocks on the same pool, as the event line
    and the status line above and below it grew and shrank with their text."""
    app = make_app(FakeEngines(), config=EngineConfig(num_blocks=4096, max_model_len=2048))
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        app.worker.send(LaunchPreset("shared", 6))
        app.worker.send(LaunchPreset("overload", 24))
        scales = set()
        for _ in range(12):
            await single_steps(pilot, 1)
            scales.add(app.main.view.block_map.map_layout.blocks_per_cell)
        assert len(scales) == 1 and scales.pop() > 1
