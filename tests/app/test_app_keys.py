"""Issue 15 §4: the keys people already know, a footer that fits, a visible focus, nothing cut."""

from __future__ import annotations

import pytest
from app_harness import FakeEngines, burst_steps, make_app, single_steps, started, type_chat, until, window
from rich.cells import cell_len

from kvscope.app.runlog import RunLogReader, record_run
from kvscope.app.screens.replay import ReplayScreen
from kvscope.app.widgets.block_map import BlockMap
from kvscope.app.widgets.block_table import BlockTable
from kvscope.app.widgets.chat import ChatPane
from kvscope.app.widgets.header import EngineHeader
from kvscope.app.widgets.key_bar import KeyBar
from kvscope.app.widgets.keys_panel import KeysPanel
from kvscope.app.widgets.queues import QueuesTable
from kvscope.app.worker.commands import AddChatTurn, LaunchPreset
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine

pytestmark = pytest.mark.anyio


def _bar_text(bar: KeyBar) -> str:
    return bar.render().plain


@pytest.mark.parametrize("width", [80, 120, 160])
async def test_the_footer_fits_and_shows_whole_keys_only(width):
    app = make_app(FakeEngines())
    async with app.run_test(size=(width, 40)) as pilot:
        await started(pilot)
        for focus in ("#chat-input", "#block-map", "#queues"):
            app.main.query_one(focus).focus()
            await pilot.pause()
            bar = app.main.query_one(KeyBar)
            text = _bar_text(bar)
            assert cell_len(text) <= bar.size.width
            shown = [f"{key} {label}" for key, label in bar.entries()]
            kept = [entry for entry in shown if entry in text]
            assert text.split("  ") == kept              # every entry whole, none cut at the edge
            assert text.startswith("q Quit  ? Keys") or focus == "#chat-input"


async def test_the_replay_footer_shows_only_the_replays_keys(tmp_path):
    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=256))
    with record_run(engine, db_path=tmp_path / "runs.db") as log:
        engine.add_request("hello there", SamplingParams(max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
    async with window((120, 36)) as (app, pilot):
        await app.push_screen(ReplayScreen(RunLogReader(tmp_path / "runs.db"), log.run_id))
        await pilot.pause()
        text = _bar_text(app.screen.query_one(KeyBar))
        assert "Prev" in text and "Next" in text and "Back" in text
        for app_key in ("F2 Pause", "F3 Step", "F1 Explain", "F9 History", "q Quit"):
            assert app_key not in text


async def test_question_mark_shows_and_hides_the_keys():
    async with window((120, 36)) as (app, pilot):
        app.main.view.block_map.focus()
        await pilot.press("question_mark")
        assert app.screen.query(KeysPanel)
        await pilot.press("question_mark")
        await pilot.pause()
        assert not app.screen.query(KeysPanel)
        assert app.focused is app.main.view.block_map


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_the_keys_panel_lists_the_apps_keys_first_folds_the_inputs_and_scrolls_by_keyboard(size):
    app = make_app(FakeEngines())
    async with app.run_test(size=size) as pilot:
        await started(pilot)
        chat_input = app.main.query_one("#chat-input")
        chat_input.focus()
        await pilot.press("question_mark")                # an empty input passes "?" on
        await pilot.pause()
        panel = app.screen.query_one(KeysPanel)
        rows = panel.rows
        assert rows[0][0] == "keys of the window" and "Quit" in rows[0][2]
        editing = [row for row in rows if row[0] == "text editing in the input"]
        assert len(editing) == 1 and rows[-1] == editing[0]     # the input's editing keys: one row, last
        quit_row = next(child for child in panel.query(".keys-row") if "Quit" in str(child.render()))
        assert quit_row.region.bottom <= panel.region.bottom     # on screen without scrolling
        assert app.focused is panel
        if panel.max_scroll_y:
            await pilot.press("pagedown")
            await pilot.pause()
            assert panel.scroll_y > 0
        await pilot.press("escape")
        await pilot.pause()
        assert not app.screen.query(KeysPanel) and app.focused is chat_input


async def test_escape_only_leaves_the_input_and_ctrl_g_stops_the_reply_from_any_panel():
    """Esc meant "abort the reply" while one streamed and "leave the input" otherwise; now it has one meaning."""
    async with window((120, 36), chat_max_tokens=200) as (app, pilot):
        chat = app.main.query_one(ChatPane)
        await type_chat(pilot, "Tell me a long story")
        await single_steps(pilot, 2)
        assert app.focused is app.main.query_one("#chat-input")
        await pilot.press("escape")                      # a reply streams: Esc still only leaves the input
        assert chat.current_request == "chat-1"
        assert app.focused is app.main.view.block_map
        await pilot.press("escape")
        assert chat.current_request == "chat-1"          # Esc on the map is the map's, not the reply's
        await pilot.press("ctrl+g")                      # the reply stops from the map as from the input
        assert chat.current_request is None
        assert "Esc leaves the input" in app.main.query_one("#chat-input").placeholder


async def test_keys_jump_to_the_map_the_queues_and_the_chat_and_the_focus_shows():
    async with window((120, 36)) as (app, pilot):
        chat_input = app.main.query_one("#chat-input")
        await pilot.press("m")                            # typed: the chat input has the focus
        assert chat_input.value == "m" and app.focused is chat_input
        chat_input.value = ""
        app.main.view.block_map.focus()
        await pilot.press("r")
        assert isinstance(app.focused, QueuesTable)
        assert app.focused.styles.border_top[0] == "heavy"    # the focus ring
        await pilot.press("m")
        assert isinstance(app.focused, BlockMap) and app.focused.styles.border_top[0] == "heavy"
        assert app.main.view.queues.styles.border_top[0] != "heavy"
        await pilot.press("c")
        assert app.focused is chat_input


async def test_whitespace_only_input_is_cleared_and_sends_nothing():
    engines = FakeEngines()
    async with window((120, 36), engines=engines) as (app, pilot):
        await type_chat(pilot, "   ")
        chat = app.main.query_one(ChatPane)
        assert app.main.query_one("#chat-input").value == ""
        assert chat.current_request is None and chat.messages == []


async def test_the_header_does_not_claim_a_prefix_cache_the_contiguous_allocator_cannot_use():
    config = EngineConfig(num_blocks=128, max_model_len=512, allocator="contiguous")
    async with window((160, 40), config=config) as (app, pilot):
        header = str(app.main.query_one(EngineHeader).render())
        assert "prefix cache on" not in header and "no prefix cache (contiguous)" in header
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert "prefix✗" in str(app.main.query_one(EngineHeader).render())


async def test_new_conversation_forgets_the_history_sent_to_the_model_and_turns_are_labelled():
    app = make_app(FakeEngines(), chat_max_tokens=6, paused=False)
    sent = []
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        chat = app.main.query_one(ChatPane)
        send = app.worker.send

        def spy(command):
            if isinstance(command, AddChatTurn):
                sent.append(command.messages)
            send(command)

        app.worker.send = spy
        await type_chat(pilot, "First question")
        await until(pilot, lambda: chat.current_request is None)
        await type_chat(pilot, "Second question")
        await until(pilot, lambda: chat.current_request is None)
        assert len(sent[-1]) == 3                          # user, assistant, user
        titles = [bubble.border_title for bubble in app.main.query(".bubble")]
        assert titles == ["you", "assistant", "you", "assistant"]
        await pilot.press("ctrl+n")
        assert chat.messages == [] and not app.main.query(".bubble")
        await type_chat(pilot, "Third question")
        await until(pilot, lambda: chat.current_request is None)
        assert [m["content"] for m in sent[-1]] == ["Third question"]


async def test_long_request_ids_and_numbers_are_never_cut():
    config = EngineConfig(num_blocks=512, max_model_len=2048, max_num_batched_tokens=512)
    async with window((120, 40), config=config) as (app, pilot):
        app.worker.send(LaunchPreset("long", 1))          # a 1,500-token prompt: "512/1536" in prefill
        app.worker.send(LaunchPreset("overload", 12))     # ids up to overload-12
        await single_steps(pilot, 1)
        table = app.main.query_one(QueuesTable)
        views = {view.request_id: view for view in app.main.latest.snapshot.requests}
        rows = [table.render_line(y).text for y in range(1, table.size.height)]
        rows = [row for row in rows if row.strip()]
        assert len(rows) >= 4 and any(row.startswith("overload-1") for row in rows)
        assert any(row.startswith("long-") for row in rows)
        for row in rows:
            view = views[row.split()[0]]                # the whole id, never "long-…"
            assert f"{min(view.num_computed_tokens, view.num_prompt_tokens)}/{view.num_prompt_tokens}" in row


async def test_the_block_table_scrolls_when_a_table_is_longer_than_the_panel():
    async with window((120, 36), config=EngineConfig(num_blocks=512, max_model_len=4096)) as (app, pilot):
        app.worker.send(LaunchPreset("sample", 1))          # four samples: four table lines, and long ones
        await burst_steps(pilot, 1, 3)
        view = app.main.latest.snapshot.requests[0]
        app.main.view.select_request(view.request_id)
        app.main.paint(force=True)
        await pilot.pause()
        table = app.main.query_one(BlockTable)
        assert table.virtual_size.height > table.size.height
        table.scroll_end(animate=False, immediate=True)
        await pilot.pause()
        last = table._row_map()[-1]
        assert table.render_line(table.size.height - 1).text.strip() == \
            "".join(s.text for s in table._wrapped[last[0]][last[1]]).strip()


def _in_sight(app, widget) -> bool:
    """The whole widget is on screen, between the header and the footer (not scrolled off, not clipped)."""
    body = app.main.view.region
    return widget.region.height == widget.outer_size.height and body.contains_region(widget.region)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=lambda size: f"{size[0]}x{size[1]}")
async def test_each_panel_key_brings_its_panel_into_sight(size):
    """Issue 25 defect 4: at 120x40 the queues sat below the fold and R focused them unseen."""
    app = make_app(FakeEngines())
    async with app.run_test(size=size) as pilot:
        await started(pilot)
        await burst_steps(pilot, 4, 2)
        queues, block_map, chat_input = app.main.view.queues, app.main.view.block_map, app.main.query_one("#chat-input")
        block_map.focus()
        await pilot.pause()
        for key, panel in (("r", queues), ("m", block_map), ("r", queues), ("c", chat_input)):
            await pilot.press(key)
            await pilot.pause()
            assert app.focused is panel and _in_sight(app, panel), (key, panel.region, app.main.view.region)


async def test_at_120x40_the_row_below_the_fold_shows_its_title_as_the_cue():
    async with window((120, 40)) as (app, pilot):
        view, queues = app.main.view, app.main.view.queues
        assert view.has_class("-scrolls") and view.max_scroll_y > 0          # there is more, and it scrolls
        assert view.region.contains(queues.region.x + 2, queues.region.y)   # the Queues' title is on screen
        await pilot.resize_terminal(160, 50)                                 # tall enough: no scrolling
        await pilot.pause()
        assert not view.has_class("-scrolls") and _in_sight(app, queues)


@pytest.mark.parametrize("width", [80, 120, 160])
async def test_the_footer_drops_the_least_needed_keys_first(width):
    app = make_app(FakeEngines())
    async with app.run_test(size=(width, 40)) as pilot:
        await started(pilot)
        app.main.view.block_map.focus()
        await pilot.pause()
        text = _bar_text(app.main.query_one(KeyBar))
        for needed in ("q Quit", "? Keys", "l Lessons", "c Chat", "m Map", "r Requests"):   # the way back included
            assert needed in text, text
        if "F7 Preempt mode" in text or "^t Theme" in text:
            assert "F9 History" in text and "F3 Step" in text


async def test_a_multi_line_paste_is_sent_whole():
    """Issue 25 defect 3: Textual's Input kept the first line of a 25-line paste, silently."""
    from textual import events

    pasted = "\n".join(f"line {i}: some pasted code, 40 characters." for i in range(25)) + "\n"
    app = make_app(FakeEngines(), config=EngineConfig(num_blocks=512, max_model_len=4096))
    sent = []
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        chat_input = app.main.query_one("#chat-input")
        chat_input.focus()
        await pilot.press("R", "e", "a", "d", ":", "space")
        chat_input.post_message(events.Paste(pasted))
        await pilot.pause()
        assert chat_input.value == "Read: [pasted 25 lines]"                      # what goes, in view
        await pilot.pause()
        note = app.main.query_one("#paste-note")
        assert str(note.render()) == f"pasted 25 lines, {len(pasted):,} characters, sent whole" and note.display
        assert chat_input.content_region.width > len(chat_input.value)      # the marker whole in the input
        await pilot.press("space", "o", "k")
        send = app.worker.send
        app.worker.send = lambda command: (isinstance(command, AddChatTurn) and sent.append(command), send(command))
        await pilot.press("enter")
        await until(pilot, lambda: sent)
        assert sent[0].messages[-1]["content"] == f"Read: {pasted} ok"          # every line of it
        assert chat_input.value == "" and chat_input.expanded("[pasted 25 lines]") == "[pasted 25 lines]"
        await pilot.pause()
        assert not app.main.query_one("#paste-note").display
        bubble = str(app.main.query(".bubble.user").last().render())
        assert "line 0:" in bubble and "line 24:" in bubble


async def test_a_paste_with_the_focus_off_the_chat_goes_to_the_chat_and_a_first_question_mark_shows_the_keys():
    """Issue 25 defect 8: after Esc the focus left the input and a paste went nowhere; `?` typed into the input."""
    from textual import events

    async with window((160, 50)) as (app, pilot):
        chat_input = app.main.query_one("#chat-input")
        await pilot.press("escape")                                  # no reply: Esc leaves the input for the map
        assert app.focused is app.main.view.block_map
        app.main.view.block_map.post_message(events.Paste("Why page the cache?"))
        await until(pilot, lambda: chat_input.value == "Why page the cache?")
        assert app.focused is chat_input
        chat_input.value = ""
        await pilot.press("question_mark")                          # empty input: the keys, as everywhere
        assert app.screen.query(KeysPanel) and chat_input.value == ""
        await pilot.press("question_mark")
        await pilot.pause()
        assert not app.screen.query(KeysPanel)
        await pilot.press("W", "h", "y", "question_mark")           # inside a question: a question mark
        assert chat_input.value == "Why?"
        text = _bar_text(app.main.query_one(KeyBar))
        assert "F10 Quit" in text


async def test_the_chat_samples_with_the_knobs_typed_on_the_command_line_and_says_so():
    knobs = (("temperature", 0.7), ("top_p", 0.9), ("repetition_penalty", 1.1))
    async with window((160, 48), chat_sampling=knobs) as (app, pilot):
        assert app.main.chat.border_subtitle == "temperature 0.7, top_p 0.9, repetition_penalty 1.1 · flags"
        sent = []
        send = app.worker.send
        app.worker.send = lambda command: (isinstance(command, AddChatTurn) and sent.append(command), send(command))
        await pilot.press("h", "i", "enter")
        await until(pilot, lambda: sent)
        params = sent[0].params
        assert (params.temperature, params.top_p, params.repetition_penalty) == (0.7, 0.9, 1.1)
        assert params.max_tokens == app.main.chat.max_tokens


async def test_greedy_knobs_leave_out_what_greedy_ignores():
    async with window((160, 48), chat_sampling=(("temperature", 0.0), ("top_k", 5), ("frequency_penalty", 0.5))) as (
            app, pilot):
        assert app.main.chat.border_subtitle == "greedy, frequency_penalty 0.5 · flags"
