"""The lessons that measure (issue 25's teaching table): sizing, latency, throughput and fragmentation's
one-partial-block bound. On FakeRunner engines with a fixed step time, so what is asserted is what the lesson
measured and how it reads it, never a wall-clock figure; the real model's figures come from
`kvscope bench lessons` (docs/teaching.md)."""

from __future__ import annotations

import math

import pytest
from app_harness import FakeEngines, window

from kvscope.app.lessons import LESSONS, fragmentation, latency, sizing, throughput
from kvscope.app.lessons.latency import inter_token_latencies, time_to_first_token
from kvscope.app.lessons.play import play
from kvscope.app.lessons.script import Moment, StepRecord
from kvscope.app.widgets.paged_vs_contiguous import compare_allocations
from kvscope.engine.outputs import EventKind, KVLayout

pytestmark = pytest.mark.anyio


async def played(name: str):
    """Play a lesson on fake engines; (the beat records, the Moment of its last beat, its runner)."""
    async with window((120, 40), FakeEngines(fixed_clock=True)) as (app, pilot):
        result = await play(pilot, name, beat_timeout=60)
        runner = app.lesson_screen.runner
        moment = Moment(runner.latest, tuple(runner.steps), dict(runner.earlier), runner.run, True,
                        tuple(runner.infos), dict(runner.earlier_runs))
        return result.beats, moment, runner


async def test_fragmentation_names_utilisation_and_the_one_partial_block_bound():
    beats, moment, _ = await played("fragmentation")
    captions = {beat.title: beat.caption for beat in beats}
    assert "KV utilisation" in captions["Every request reserves max_model_len"]
    assert "at most one partly filled block per request" in captions["The same requests, paged"]
    short = compare_allocations(moment.earlier["paged"].snapshot, 256)
    long = compare_allocations(moment.earlier["long"].snapshot, 256)
    assert long.paged_waste < short.paged_waste                          # shorter requests waste more
    block = moment.earlier["long"].snapshot.block_size
    assert long.paged_slots - long.paged_tokens < len(fragmentation.LONG_PROMPTS) * block   # under a block each
    assert "shorter requests waste more" in captions["Longer requests: about 4%"]


def record(step: int, duration: float, **generated) -> StepRecord:
    from app_harness import replace

    from kvscope.app.widgets.snapshot_view import empty_step

    _, stats = empty_step(8, 16, "paged")
    return StepRecord(1, replace(stats, step=step, duration=duration), (), (), len(generated),
                      tuple(generated.items()))


def test_time_to_first_token_and_inter_token_latency_come_from_the_steps_each_token_waited_for():
    steps = (record(1, 0.01, a=0), record(2, 0.02, a=1, b=0), record(3, 0.30, a=2, b=0), record(4, 0.02, a=3, b=1))
    assert time_to_first_token(steps, "a") == pytest.approx(0.03)       # arrived in step 1, first token in step 2
    assert time_to_first_token(steps, "b") == pytest.approx(0.34)       # steps 2, 3 and 4
    assert inter_token_latencies(steps, "a") == pytest.approx([0.30, 0.02])


async def test_latency_measures_each_budget_and_plots_them_side_by_side():
    beats, moment, _ = await played("latency")
    runs = {budget: latency.measure(moment, moment.earlier_runs[f"budget-{budget}"]) for budget in latency.BUDGETS}
    chunks = [len(runs[budget]["chunks"]) for budget in latency.BUDGETS]
    assert chunks == sorted(chunks, reverse=True) and chunks[-1] == 1 and chunks[0] > 3    # 32: many chunks; 256: one
    # Every fake step takes the same time, so the first token waits for as many steps as there were chunks.
    ttft = [runs[budget]["ttft"] for budget in latency.BUDGETS]
    assert ttft == sorted(ttft, reverse=True) and ttft[0] > ttft[-1]
    figures = beats[-1].caption
    assert figures.count("█") > 6 and all(f"budget {b}" in figures for b in latency.BUDGETS)   # a plot, not a sentence
    assert "time to first token" in figures and "gap between two tokens" in figures


async def test_throughput_runs_both_allocators_on_the_same_pool_and_reads_their_rates():
    beats, moment, _ = await played("throughput")
    contiguous = throughput.measure(moment, moment.earlier_runs["contiguous"])
    paged = throughput.measure(moment, moment.earlier_runs["paged"])
    pools = {key: moment.info_at(key).runner.num_device_blocks for key in ("contiguous", "paged")}
    assert pools == {"contiguous": 64, "paged": 64}
    assert contiguous["batch"] == 4 and paged["batch"] > 2 * contiguous["batch"]
    assert contiguous["tokens"] == paged["tokens"] == throughput.NUM_REQUESTS * throughput.MAX_TOKENS
    assert paged["rate"] > contiguous["rate"]
    figures = beats[-1].caption
    assert f"{paged['rate'] / contiguous['rate']:.2f}×" in figures and "On a GPU" in figures and "tok/s" in figures


def test_a_tokens_kv_bytes_are_worked_out_from_the_model_shape():
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, element_bytes=4)     # SmolLM2-135M, fp32
    assert layout.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080


async def test_sizing_builds_each_pool_from_its_budget_and_runs_the_printed_concurrency_rounded_down():
    beats, moment, runner = await played("sizing")
    assert all(beat.met for beat in beats)
    for key, _label in sizing.RUNS:
        info, result = moment.info_at(key), moment.earlier[key]
        budget = info.config.kv_cache_memory
        runner = info.runner
        assert runner.num_device_blocks == budget // (runner.kv_layout.bytes_per_token * runner.block_size)   # its pool
        running = sum(1 for v in result.snapshot.requests if v.queue == "running")
        assert running == min(sizing.NUM_REQUESTS, math.floor(info.num_tokens / info.runner.max_model_len))
    pools = {key: moment.info_at(key) for key, _ in sizing.RUNS}
    budget, more = pools["budget"].runner, pools["more-budget"].runner
    assert more.num_device_blocks in (2 * budget.num_device_blocks, 2 * budget.num_device_blocks + 1)
    assert pools["dtype"].runner.kv_layout.bytes_per_token * 2 == budget.kv_layout.bytes_per_token
    first = beats[0].caption
    assert "2 × 30 × 3 × 64 × 4 B = [b]46,080 bytes a token" in first       # the formula, from the model's shape
    assert "Maximum concurrency for 128 tokens per request: 5.62x" in beats[1].caption     # as vLLM prints it
    assert "printed" in beats[-1].caption and "gpu_memory_utilization" in beats[-1].caption


def test_the_new_lessons_are_listed():
    assert {"sizing", "latency", "throughput"} <= set(LESSONS)


async def test_preemptions_swap_in_counts_the_blocks_actually_copied_back():
    """The caption said blocks "2 → 6" came back from the host pool where one block had been swapped: the event
    lists the whole table, with a block newly allocated for the next token."""
    beats, moment, runner = await played("preemption")
    caption = next(beat.caption for beat in beats if beat.title == "And back in")
    steps = list(runner.steps)
    at = next(i for i, r in enumerate(steps) if any(e.kind == EventKind.SWAP_IN for e in r.events))
    before = steps[at - 1].stats.num_swapped_in_blocks if steps[at - 1].run == steps[at].run else 0
    copied = steps[at].stats.num_swapped_in_blocks - before
    table = next(e.blocks for e in steps[at].events if e.kind == EventKind.SWAP_IN)
    assert copied < len(table) or "new for the tokens" not in caption
    assert f"{copied} swapped {'block was' if copied == 1 else 'blocks were'} copied back" in caption


def test_the_latency_conclusion_says_only_what_its_own_figures_show():
    """A busy CPU gave budget 32 a longer gap than 256 and the same TTFT, under a fixed sentence saying the
    opposite: the conclusion is now read from the figures, and says when noise hides the effect."""
    def runs(ttft_small, ttft_large, gap_small, gap_large):
        return [("budget 32", {"ttft": ttft_small, "itl_max": gap_small}),
                ("budget 96", {"ttft": 0.5, "itl_max": 0.25}),
                ("budget 256", {"ttft": ttft_large, "itl_max": gap_large})]

    busy = latency.conclusion(runs(0.510, 0.513, 0.299, 0.232))
    assert "sooner" not in busy and "wait longer" not in busy
    assert "noise" in busy and "510 ms" in busy and "299 ms" in busy
    clear = latency.conclusion(runs(0.900, 0.300, 0.040, 0.300))
    assert "gave r3 its first token sooner" in clear and "wait longer between tokens" in clear
    assert "noise" not in clear.split("Where the effects")[0]
    # Measured on a busy CPU: the middle budget slowest of all, beyond both ends.
    middle = [runs(1.367, 1.115, 0.259, 1.115)[0], ("budget 96", {"ttft": 2.090, "itl_max": 0.953}),
              runs(1.367, 1.115, 0.259, 1.115)[2]]
    assert "budget 96's time to first token, 2,090 ms, is outside both ends" in latency.conclusion(middle)


def test_throughputs_ratio_is_told_as_a_gain_only_above_the_noise():
    from kvscope.app.lessons.words import NOISE, compared

    assert compared(200.0, 342.9) == 1
    assert compared(200.0, 200.0 * (1 + NOISE / 2)) == 0 and compared(200.0, 150.0) == -1
