"""The lessons that measure (issue 25's teaching table): sizing, latency, throughput and fragmentation's
one-partial-block bound. On FakeRunner engines with a fixed step time, so what is asserted is what the lesson
measured and how it reads it, never a wall-clock figure; the real model's figures come from
`kvscope bench lessons` (docs/teaching.md)."""

from __future__ import annotations

import pytest
from test_app_harness import FakeEngines, make_app, started

from kvscope.app.lessons import fragmentation
from kvscope.app.lessons.play import play
from kvscope.app.lessons.script import Moment
from kvscope.app.widgets.paged_vs_contiguous import compare_allocations

pytestmark = pytest.mark.anyio


async def played(name: str):
    """Play a lesson on fake engines; (the beat records, the Moment of its last beat, its runner)."""
    app = make_app(FakeEngines(fixed_clock=True))
    async with app.run_test(size=(120, 40)) as pilot:
        await started(pilot)
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
