"""Issue 15 §2 and §3: presets and chat sized to the pool, one warning instead of a stack of toasts, and
the window saying what just happened (event line, recently finished, the vLLM-style status line)."""

from __future__ import annotations

import numpy as np
import pytest
from app_harness import FakeEngines, burst_steps, make_app, single_steps, started, type_chat, until, window

from kvscope.app.load.presets import PRESETS, PresetContext, build, fit_reply
from kvscope.app.widgets.event_line import narrate, readable_previous
from kvscope.app.widgets.queue_rows import FINISHED_KEEP_STEPS
from kvscope.app.widgets.queues import QueuesTable
from kvscope.app.widgets.status_line import RateWindow, describe_status
from kvscope.app.worker.commands import AbortRequest, AddRequest, LaunchPreset
from kvscope.app.worker.step_posting import thinned
from kvscope.engine.config import EngineConfig, RequestError, SamplingParams
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.outputs import EngineEvent

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("num_blocks, max_model_len", [(96, 2048), (64, 256), (16, 4096)])
@pytest.mark.parametrize("key", list(PRESETS))
def test_every_preset_request_fits_the_pool_it_runs_on(key, num_blocks, max_model_len):
    """"Long prompts" on a 96-block pool refused all three of its requests: each one was longer than the pool."""
    # Long prompts must outgrow a step to mean anything: a budget they can (one they cannot is refused, below).
    budget = {"max_num_batched_tokens": 64} if key == "long" else {}
    engine = fake_engine(EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, **budget))
    context = PresetContext.from_engine(engine)
    for item in build(key, PRESETS[key].default_count, context):
        engine.add_request(item.prompt, item.params)     # RequestError would fail the test


@pytest.mark.parametrize("key", list(PRESETS))
def test_a_preset_applies_the_chat_template_once_per_request(key, monkeypatch):
    """A preset sizes each reply from the templated prompt and queues that very prompt: no second template."""
    engine = fake_engine(EngineConfig(num_blocks=96, max_model_len=2048, max_num_batched_tokens=64))
    calls = []
    template = engine.tokenizer.apply_chat_template
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or template(*a, **k))
    planned = build(key, PRESETS[key].default_count, PresetContext.from_engine(engine))
    for item in planned:
        engine.add_request(item.prompt, item.params)
    assert len(calls) == len(planned)


def test_a_contiguous_pool_smaller_than_one_row_refuses_the_preset_once_and_says_what_would_fit():
    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=2048, allocator="contiguous"))
    context = PresetContext.from_engine(engine)
    with pytest.raises(ValueError, match="no request can run; try --max-model-len 256"):
        build("burst", 16, context)


def test_the_chat_reply_shrinks_to_what_max_model_len_leaves():
    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=256))
    context = PresetContext.from_engine(engine)
    messages = [{"role": "user", "content": "Hello"}]
    prompt, num_tokens = context.chat_prompt(messages)
    max_tokens = fit_reply(context, num_tokens, 256)
    # The templated prompt as the engine counts it (a transformers 5 BatchEncoding's len() is its 2 keys).
    assert num_tokens == len(engine.prompt_token_ids(messages)) > 2
    assert max_tokens == 256 - num_tokens
    with pytest.raises(RequestError):
        engine.add_request(messages, SamplingParams(max_tokens=256))
    engine.add_request(messages, SamplingParams(max_tokens=max_tokens))


async def test_hello_is_answered_with_max_model_len_256():
    app = make_app(FakeEngines(), config=EngineConfig(num_blocks=64, max_model_len=256), chat_max_tokens=256,
                   paused=False)
    async with app.run_test(size=(120, 36)) as pilot:
        await started(pilot)
        await type_chat(pilot, "Hello")
        chat = app.main.chat
        await until(pilot, lambda: chat.current_request is None)
        assert chat.messages[-1]["role"] == "assistant"
        assert not app.main.query(".bubble.error")


async def test_switching_to_an_allocator_that_fits_no_request_warns_once_not_once_per_request():
    async with window((160, 48), config=EngineConfig(num_blocks=64, max_model_len=2048)) as (app, pilot):
        app.action_toggle_allocator()
        await until(pilot, lambda: app.main.engine_info.config.allocator == "contiguous")
        app.worker.send(LaunchPreset("burst", 16))
        await pilot.pause(0.5)
        alarms = [n for n in app._notifications if n.severity in ("warning", "error")]
        assert len(alarms) == 2, [n.message for n in alarms]     # the switch's warning, the preset's refusal
        assert "try --max-model-len 256" in alarms[0].message
        assert alarms[1].title == "LaunchPreset refused" and alarms[1].message.startswith("the contiguous allocator")
        assert app.main.latest is None or not app.main.latest.snapshot.requests


async def test_refusals_arriving_together_are_told_in_one_toast():
    async with window((120, 36), config=EngineConfig(num_blocks=64, max_model_len=256)) as (app, pilot):
        from kvscope.app.messages import RequestRejected

        for i in range(16):
            app.post_message(RequestRejected(f"burst-{i}", "request could never fit in the KV cache"))
        await pilot.pause(0.5)
        errors = [n for n in app._notifications if n.severity == "error"]
        assert len(errors) == 1 and errors[0].title == "16 requests refused"


# --- §3: say what just happened ---------------------------------------------------------------


def test_narration_names_the_step_its_work_and_its_events():
    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=256, max_num_batched_tokens=64))
    engine.add_request("x" * 40, SamplingParams(max_tokens=4), request_id="a")
    first = engine.step()
    engine.add_request("y" * 150, SamplingParams(max_tokens=4), request_id="b")
    second = engine.step()
    line = narrate(second.stats, second.events, second.snapshot, first.snapshot)
    assert line.startswith(f"[b]step {second.stats.step}[/b]: 1 decode, 1 prefill chunk (63 tokens)")
    assert "admitted b" in line
    events = (EngineEvent("copy_on_write", "c", (94, 78)), EngineEvent("evict", "c", (3, 4)),
              EngineEvent("swap_out", "burst-13", (1, 2)), EngineEvent("preempt", "burst-13", (1, 2), "swap"),
              EngineEvent("preempt", "d", (5,), "recompute"), EngineEvent("finish", "a", (), "length"))
    line = narrate(second.stats, events, second.snapshot)
    for part in ("copy-on-write 94→78", "evicted 2 cached blocks", "swapped out burst-13",
                 "preempted d (recompute)", "finished a", "prefill 63 tokens"):
        assert part in line, part
    assert "preempted burst-13" not in line      # a swap preemption is told as the swap


def test_a_step_before_that_came_thinned_is_not_read_as_an_empty_pool():
    """The engine process sends the step before the newest without its views where the newest computed no prompt
    tokens: read as a pool with no requests, every running request looked newly admitted."""
    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=256, max_num_batched_tokens=64))
    engine.add_request("x" * 40, SamplingParams(max_tokens=8), request_id="a")
    first = engine.step()
    engine.add_request("y" * 30, SamplingParams(max_tokens=8), request_id="b")
    second = engine.step()
    assert readable_previous(first) is first.snapshot
    assert readable_previous(None) is None
    bare = thinned(first, set())
    assert readable_previous(bare) is None
    assert "admitted b" in narrate(second.stats, second.events, second.snapshot, readable_previous(first))
    assert "admitted" not in narrate(second.stats, second.events, second.snapshot, readable_previous(bare))
    idle = fake_engine(EngineConfig(num_blocks=64, max_model_len=256)).step()
    assert readable_previous(idle) is idle.snapshot      # truly empty: read as it is


async def test_the_event_line_narrates_each_step_live_and_in_replay(tmp_path):
    engines = FakeEngines(fixed_clock=True)
    async with window((160, 48), engines, log_enabled=True, db_path=tmp_path / "runs.db") as (app, pilot):
        await burst_steps(pilot, 3, 2)
        line = str(app.main.view.event_line.render())
        assert line == "step 2: 3 decodes"
        await single_steps(pilot, 1)
        run_id = app.run_id
        from kvscope.app.runlog import RunLogReader
        from kvscope.app.screens.replay import ReplayScreen

        await until(pilot, lambda: 3 in RunLogReader(tmp_path / "runs.db").recorded_steps(run_id))
        replay = ReplayScreen(RunLogReader(tmp_path / "runs.db"), run_id)
        await app.push_screen(replay)
        replay.jump_to_step(1)
        assert str(replay.view.event_line.render()).startswith("step 1: prefill")
        replay.action_step(1)
        assert str(replay.view.event_line.render()) == "step 2: 3 decodes"


async def test_finished_requests_stay_a_while_in_the_queues():
    async with window((160, 48), config=EngineConfig(num_blocks=128, max_model_len=512)) as (app, pilot):
        await burst_steps(pilot, 3, 1)
        table = app.main.query_one(QueuesTable)
        gone = table.order[0]
        app.worker.send(AbortRequest(gone))
        await single_steps(pilot, 1)
        assert gone not in table.rows and gone in table.finished
        row = next(table.render_line(y).text for y in range(1, 6) if table.render_line(y).text.startswith(gone))
        assert "✗ abort" in row
        assert "finished 1" in table.border_title
        await single_steps(pilot, FINISHED_KEEP_STEPS)
        assert gone not in table.finished


def test_the_status_line_reads_as_vllm_logs_it():
    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=256))
    engine.add_request("hello there", SamplingParams(max_tokens=8))
    window = RateWindow()
    result = None
    for _ in range(3):
        result = engine.step()
        window.push(result.stats)
    prompt, generation = window.rates()
    assert prompt > 0 and generation > 0
    text = describe_status(prompt, generation, result.snapshot, result.stats, "cpu")
    assert text.startswith("Avg prompt throughput: ")
    for name in ("tokens/s, Avg generation throughput: ", "Running: 1 reqs", "Waiting: 0 reqs",
                 "CPU KV cache usage: ", "Prefix cache hit rate: "):
        assert name in text
    assert "GPU KV cache usage" in describe_status(0, 0, result.snapshot, result.stats, "cuda:0")


def test_the_rate_window_averages_over_ten_seconds_of_steps():
    from app_harness import replace

    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=256))
    engine.add_request("hello there", SamplingParams(max_tokens=8))
    stats = engine.step().stats
    window = RateWindow()
    for second in range(30):
        window.push(replace(stats, time=100.0 + second, duration=0.5, num_prefill_tokens=10))
    prompt, _ = window.rates()
    assert prompt == pytest.approx(11 * 10 / 10.0)     # the steps ending in the last ten seconds
    assert np.isfinite(prompt)


async def test_launched_requests_show_as_waiting_at_once_even_while_paused():
    async with window((160, 48)) as (app, pilot):
        app.worker.send(LaunchPreset("burst", 4))
        table = app.main.query_one(QueuesTable)
        await until(pilot, lambda: len(table.rows) == 4)
        assert app.main.latest is None                       # no step has run
        assert {cells[1] for cells in table.rows.values()} == {"waiting"}
        assert "waiting 4" in table.border_title


async def test_a_finished_row_shows_the_requests_final_numbers_not_the_last_drawn_ones():
    async with window((160, 48), config=EngineConfig(num_blocks=128, max_model_len=512)) as (app, pilot):
        app.worker.send(AddRequest("short", "hello there", SamplingParams(max_tokens=3)))
        await single_steps(pilot, 2)
        table = app.main.query_one(QueuesTable)
        assert table.rows["short"][4] == "2/3"     # drawn after its second token
        await single_steps(pilot, 1)                # the third token, and the finish
        row, _ = table.finished["short"]
        assert row[1] == "✓ length" and row[4] == "3/3"


def test_long_prompts_on_the_teaching_pool_say_why_nothing_would_chunk_and_what_would():
    """Issue 25 defect 13: the preset promised chunks, and on --teach (2,048-token steps, 256-token requests) none
    came."""
    from kvscope.app.lessons.load import teach_config

    engine = fake_engine(teach_config(EngineConfig()))
    context = PresetContext.from_engine(engine)
    with pytest.raises(ValueError, match="none would be split into chunks; start with --max-num-batched-tokens"):
        build("long", 3, context)
    engine = fake_engine(teach_config(EngineConfig(), max_num_batched_tokens=32))
    planned = build("long", 3, PresetContext.from_engine(engine))
    assert all(len(engine.prompt_token_ids(p.prompt)) > 32 for p in planned)
