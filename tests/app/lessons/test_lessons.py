"""Lessons on the FakeRunner: every beat is reached at its moment, the captions carry the run's numbers,
Backspace replays an earlier beat from the run log, and `kvscope lesson` / `--teach` open what they say."""

from __future__ import annotations

import pytest
from app_harness import FakeEngines, make_app, started, until, window

from kvscope.app import cli
from kvscope.app.lessons import LESSONS
from kvscope.app.lessons.continuous_batching import static_steps
from kvscope.app.lessons.load import TEACH_POOL, teach_config
from kvscope.app.lessons.play import play
from kvscope.app.widgets.block_cells import GLYPH_SLOTS, NUM_BASE_STYLES, OVERLAY_MARKED
from kvscope.app.widgets.lesson_panel import MORE
from kvscope.engine.config import EngineConfig
from kvscope.engine.fake_runner import fake_engine

pytestmark = pytest.mark.anyio


def lesson_app():
    return make_app(FakeEngines(fixed_clock=True))


@pytest.mark.parametrize("name", list(LESSONS))
async def test_every_beat_of_the_lesson_happens_on_the_engine_and_the_last_fits_the_panel(name):
    """Each lesson played once at 120x40: every beat met with a caption, the run to its end; then the last beat's
    table rows and bars fit the panel unwrapped, and "more below" is cued exactly when the panel scrolls."""
    app = lesson_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        played = await play(pilot, name, beat_timeout=60)
        assert [record.title for record in played.beats] == [beat.title for beat in LESSONS[name].beats]
        assert all(record.met for record in played.beats), [r.title for r in played.beats if not r.met]
        assert all(record.caption.strip() for record in played.beats)
        assert played.steps > 0 and not app.lesson_screen.runner.latest.snapshot.requests   # ran to the end
        await pilot.pause()
        panel = app.lesson_screen.panel
        text = str(panel.render())
        assert "figures" in text.lower() or LESSONS[name].beats[-1].title in text
        width = panel.scrollable_content_region.width
        for line in text.split("\n"):
            if "  " in line.strip() or "█" in line:       # a table row or a bar: it must not wrap
                assert len(line) <= width, line
        # The cue follows the panel's layout, which may still be settling (a scrollbar appearing re-wraps the
        # text): wait for it, within the harness's timeout, rather than read it after one pause.
        if panel.max_scroll_y:
            await until(pilot, lambda: panel.border_subtitle == MORE)
            await pilot.press("end")
            await until(pilot, lambda: panel.border_subtitle == "")
        else:
            assert not panel.border_subtitle


async def test_backspace_replays_the_earlier_beat_from_the_run_log_and_space_comes_back():
    app = lesson_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        played = await play(pilot, "copy-on-write", beat_timeout=60)
        screen, runner = app.lesson_screen, app.lesson_screen.runner
        first = played.beats[0]
        await pilot.press("backspace", "backspace")
        await until(pilot, lambda: "replayed from the run log" in str(screen.panel.render()))
        assert runner.showing == 0
        assert screen.view.counters.stats.step == first.step      # the logged step, not the live one
        assert screen.view.block_map.selected_request == first.highlight.request_id
        assert f"step {first.step}" in str(screen.panel.render())
        await pilot.press("backspace")                             # nothing before the first beat
        assert runner.showing == 0
        await pilot.press("space", "space")
        await until(pilot, lambda: runner.showing == 2)
        assert "replayed" not in str(screen.panel.render())        # the live beat again
        assert screen.view.counters.stats == runner.latest.stats


async def test_a_beat_points_at_its_blocks_in_the_map():
    app = lesson_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        marked = []

        async def look(index, record):
            if index == 1:
                await pilot.pause()
                overlays = app.lesson_screen.view.block_map._codes // GLYPH_SLOTS // NUM_BASE_STYLES
                marked.extend(int(cell) for cell in (overlays == OVERLAY_MARKED).nonzero()[0])
                marked.append(record.highlight.blocks)

        await play(pilot, "copy-on-write", on_beat=look, beat_timeout=60)
        *cells, blocks = marked
        assert blocks and sorted(cells) == sorted(set(blocks))    # one cell per block on the teaching pool


async def test_leaving_a_lesson_returns_to_the_app_with_its_own_engine_again():
    engines = FakeEngines(fixed_clock=True)
    async with window((120, 40), engines=engines) as (app, pilot):
        await play(pilot, "continuous-batching", beat_timeout=60)
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main and app.lesson_screen is None)
        await until(pilot, lambda: app.main.engine_info.config.num_blocks == 128)
        assert engines.built[-1].config == app.config


async def test_the_palette_lists_each_lesson():
    app = lesson_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        titles = [command.title for command in app.get_system_commands(app.screen)]
        assert [t for t in titles if t.startswith("Lesson: ")] == [f"Lesson: {name}" for name in LESSONS]


def test_a_beat_title_set_before_the_screen_is_composed_or_after_it_is_gone_does_not_raise():
    from kvscope.app.screens.lesson import LessonScreen

    lesson = LESSONS["block-tables"]
    screen = LessonScreen(lesson, teach_config(EngineConfig(), **lesson.config))
    screen.show_running(0, lesson.beats[0])       # queried the unmounted screen for its title before: NoMatches
    assert "beat 1 of" in str(screen.title_line.render()) and "running" in str(screen.title_line.render())


def test_static_batches_wait_for_their_longest_request():
    assert static_steps([14, 4, 9, 17, 10, 6]) == 17 + 10
    assert static_steps([3]) == 3


def test_lesson_list_prints_one_name_per_line(capsys):
    assert cli.main(["lesson", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == list(LESSONS)
    assert len(LESSONS) >= 7


def test_an_unknown_lesson_or_a_missing_model_is_one_clear_error_and_no_window(monkeypatch, capsys, tmp_path):
    opened = []
    monkeypatch.setattr("kvscope.app.app.run_app", lambda config, **kwargs: opened.append(config))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["lesson", "no-such-lesson"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "invalid choice: 'no-such-lesson'" in error and "fragmentation" in error
    assert cli.main(["lesson", "preemption", "--model", str(tmp_path / "no-such-model")]) == 2
    error = capsys.readouterr().err
    assert "no-such-model" in error and "Traceback" not in error
    assert opened == []


def open_nothing_but_the_engine_config(monkeypatch, opened: dict) -> None:
    """The command line as a user runs it, up to the window: ``opened`` gets what run_app was given. The engine it
    builds first runs on the FakeRunner: these tests are about the config chosen, not the model's load."""
    monkeypatch.setattr("kvscope.app.cli.first_engine", fake_engine)
    monkeypatch.setattr("kvscope.app.app.run_app", lambda config, **kwargs: opened.update(config=config, **kwargs))


def test_lesson_opens_the_app_on_the_teaching_pool(monkeypatch):
    opened = {}
    open_nothing_but_the_engine_config(monkeypatch, opened)
    cli.main(["lesson", "preemption", "--no-log"])
    assert opened["lesson"] == "preemption" and opened["log_enabled"] is False
    assert opened["config"].num_blocks == TEACH_POOL["num_blocks"]
    cli.main(["lesson"])
    assert opened["lesson"] == ""          # the list of lessons


def test_teach_picks_the_pool_unless_a_flag_says_otherwise(monkeypatch):
    opened = {}
    open_nothing_but_the_engine_config(monkeypatch, opened)
    cli.main(["--teach"])
    assert (opened["config"].num_blocks, opened["config"].max_model_len) == (64, 256)
    cli.main(["--teach", "--num-blocks", "96"])
    assert (opened["config"].num_blocks, opened["config"].max_model_len) == (96, 256)
    assert teach_config(EngineConfig(), num_blocks=10).num_blocks == 10


def test_a_beat_that_builds_a_new_engine_lets_the_old_one_finish_its_requests_first():
    """Rebuilding under requests in flight would abort them: the lesson's runs would end 'interrupted' and its
    figures miss their last steps. The runner runs the old engine until all done, then rebuilds."""
    from kvscope.app.lessons.cues import after_steps
    from kvscope.app.lessons.runner import LessonRunner
    from kvscope.app.lessons.script import Beat, Lesson
    from kvscope.app.worker.commands import LaunchPlan, Rebuild, RunUntil, SetPaused
    from kvscope.engine.fake_runner import fake_engine

    lesson = Lesson("two-runs", "Two runs", "", beats=(
        Beat("first", "First", lambda m: "first", until=after_steps(1), load=lambda ctx: []),
        Beat("second", "Second", lambda m: "second", until=after_steps(1), config={"allocator": "contiguous"},
             load=lambda ctx: [])))
    sent, shown = [], []

    class Display:
        def show_running(self, index, beat):
            pass

        def show_live(self, record, result):
            shown.append(record.title)

        def show_past(self, record):
            pass

    engine = fake_engine(teach_config(EngineConfig()))
    runner = LessonRunner(lesson, teach_config(EngineConfig()), sent.append, Display())
    runner.start()
    runner.engine_ready()
    engine.add_request([1, 2, 3], None)
    runner.stepped(engine.step())
    runner.until_done(1, True)
    assert shown == ["First"]
    sent.clear()
    assert runner.forward()
    assert [type(c) for c in sent] == [RunUntil]                  # the old engine first finishes its request
    while engine.has_unfinished_requests():
        runner.stepped(engine.step())
    runner.until_done(runner.latest.stats.step, True)
    # Then the new one is built, paused, so that its load waits for its condition.
    assert [type(c) for c in sent] == [RunUntil, SetPaused, Rebuild, LaunchPlan, RunUntil]
    assert sent[1] == SetPaused(True) and sent[2].config.allocator == "contiguous" and shown == ["First"]


async def test_leaving_a_lesson_gives_the_app_back_running_as_it_was():
    """Issue 25 defect 13: leaving a lesson landed in a paused app, the lesson's step cap still on."""
    engines = FakeEngines(fixed_clock=True)
    async with window((120, 40), engines=engines, paused=False) as (app, pilot):
        assert not app.worker.state.paused
        await play(pilot, "copy-on-write", beat_timeout=60)
        assert app.worker.state.paused                    # a lesson stops at its beats
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main and app.main.engine_info.config.num_blocks == 128)
        await until(pilot, lambda: not app.worker.state.paused and app.worker.state.steps_per_s_cap is None)


async def test_captions_say_what_the_screen_shows():
    """Issue 25 defect 9: "its blocks (3)" read as three blocks; "prompts of 48 tokens or fewer" was their sum;
    block-tables counted one table's jumps, then every table's; the last beat still said "Space: next"."""
    from kvscope.app.widgets.lesson_panel import KEYS, LAST_KEYS

    app = lesson_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        beats = {beat.title: beat.caption for beat in (await play(pilot, "preemption", beat_timeout=60)).beats}
        preempt = beats["Out of blocks: the latest arrival goes"]
        assert "its block " in preempt or "its 2 blocks (" in preempt
        assert "of 48 tokens or fewer" not in beats["Recompute mode: all done"]
        assert "tokens in all: the" in beats["Recompute mode: all done"]
        panel = str(app.lesson_screen.panel.render())
        assert "Space: next" not in panel and "The end of the lesson" in panel
        assert "Space: next" in KEYS and "Space" not in LAST_KEYS
        figures = (await play(pilot, "block-tables", beat_timeout=60)).beats[-1].caption
        assert "jumps in r5's table" in figures and "jumps in every table then" in figures


async def test_the_lesson_pickers_title_wraps_inside_its_dialog():
    """Issue 25 defect 10: the picker's title ran past the dialog's edge and was cut."""
    app = lesson_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        app.action_lessons()
        await pilot.pause()
        dialog = app.screen.query_one("#lesson-menu")
        title = dialog.query_one(".dialog-text")
        assert title.region.width <= dialog.content_region.width and title.region.height >= 2


async def test_lesson_runs_are_named_for_their_lesson_and_leave_no_empty_runs(tmp_path, capsys):
    """Issue 25 defect 11: every lesson start added an empty 0-request run (8 of 25), lesson runs said only
    "started by app", and `kvscope runs` had no source column."""
    from kvscope.app.runlog import RunLogReader

    path = tmp_path / "runs.db"
    async with window((120, 40), FakeEngines(fixed_clock=True), db_path=path, log_enabled=True) as (app, pilot):
        for name in ("copy-on-write", "continuous-batching"):
            await play(pilot, name, beat_timeout=60)
            await pilot.press("escape")
            await until(pilot, lambda: app.screen is app.main and app.main.engine_info.config.num_blocks == 128)
        app.main.view.block_map.focus()
        await pilot.press("q")      # as a user quits: the app goes once its engine thread has closed the run log
        await until(pilot, lambda: not app.is_running)
    reader = RunLogReader(path)
    runs = reader.list_runs()
    assert all(run["num_requests"] > 0 for run in runs), [(r["id"], r["source"]) for r in runs]   # none empty
    assert sorted({(run["source"], run["label"]) for run in runs}) == [
        ("lesson", "continuous-batching"), ("lesson", "copy-on-write")]
    reader.close()
    assert cli.main(["runs", "--db", str(path)]) == 0
    listed = capsys.readouterr().out
    assert "source" in listed.splitlines()[0] and "lesson copy-on-write" in listed


async def test_backspace_with_the_run_log_on_a_directory_says_why_it_cannot_go_back(tmp_path):
    """--db pointing at a directory: the log cannot open, and Backspace did nothing without a word."""
    app = make_app(FakeEngines(fixed_clock=True), db_path=tmp_path, log_enabled=True)
    notices = []
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
        await play(pilot, "copy-on-write", beat_timeout=60, stop_at=1)
        app.lesson_screen.notify = lambda message, **kwargs: notices.append((message, kwargs.get("title")))
        await pilot.press("backspace")
        await pilot.pause()
        assert app.lesson_screen.runner.showing == 1             # stays on the beat it can show
        assert notices and notices[-1][1] == "Cannot go back" and "run log" in notices[-1][0]
