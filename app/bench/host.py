"""`kvscope bench host`: the host's work in one engine step, phase by phase, with no forward.

On a GPU a small model's forward takes a few milliseconds, and everything the host does around it (choosing the
batch, flattening it into tensors, recording the result, publishing the pool's state, sampling) stands between
two forwards. This bench is the scoreboard for that work: the thread CPU time (time.thread_time_ns) of each phase,
so the figures hold on a machine shared with other work, as medians and p10-p90 over the measured steps.

The engine runs on a FakeRunner with its checks off (no model, no KV tensor; its token choice is the untimed
"forward"), with the default model's tokenizer once fetched (else the FakeRunner's bytes), so detokenizing costs
what a user's chat does. Each step is driven here in LLMEngine._step's order, one function per phase; a change
to what the engine does in a step belongs in the matching function:

- schedule (``phase_schedule``): Scheduler.schedule(): the batch, block allocation, prefix-cache lookups.
- prepare (``phase_prepare``): the real ModelRunner._prepare over that batch, ordered as ModelRunner._run orders
  it: token ids, positions, slot mapping and padded block tables as CPU tensors. The runner has no model and a
  pool of the right block count but zero bytes (``input_runner``); no forward runs.
- update (``phase_update``): Scheduler.update_from_output(): tokens appended, stop checks, detokenizing, outputs.
- snapshot (``phase_snapshot``): Scheduler.cache_state() and build_snapshot(): the pool's changes and the
  requests' state a step publishes (the running requests' views are built only when read, which the run log
  does not).
- events (``phase_events``): build_stats() and Scheduler.take_events(): the step's counters and events, and the
  StepResult they make.
- run-log (``phase_run_log``): RowBuilder.add(): what the run log's writer thread makes of the step (its rows and
  the snapshot's delta, a keyframe every 50 to 500 frames). It runs on another thread but holds the same GIL. The
  first measured step is a keyframe, so the column's p90 or max shows a keyframe where few steps are measured.
- sampler (``time_sampler``): the real Sampler over random float32 logits of SmolLM2's vocabulary (49,152) on CPU
  with one torch thread, greedy and at temperature 0.7 / top-p 0.95. It depends on the batch alone, so it is
  measured once per batch and shown on that batch's rows. The title says whether the C++ kernels served it.

"engine" is the sum of schedule, prepare, update, snapshot and events in each step: the engine thread's share.

Each request decodes with a context of ``context`` tokens. So that 256 of them fit in 4,096 blocks, as a chat
server's shared system prompt lets them, each context is a shared prefix (7/8 of it, whole blocks; a one-token
request computes it first, so the others find it cached), 8 prompt tokens of its own, and the rest generated
before the measured steps, so costs that grow with what a request has generated show.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvscope.app.bench.report import titled_table
from kvscope.app.bench.scheduler import text_tokenizer
from kvscope.app.bench.scoreboard import HostSettings
from kvscope.app.runlog.records import LoggedStep, RowBuilder, Rows
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import FakeRunner
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.outputs import StepResult
from kvscope.engine.scheduler import SchedulerOutput
from kvscope.engine.snapshot import PhaseTimes, build_snapshot, build_stats

PHASES = ("schedule", "prepare", "update", "snapshot", "events", "run-log")
ENGINE_PHASES = PHASES[:5]
SAMPLERS = {"greedy": {"temperature": 0.0}, "t0.7/p0.95": {"temperature": 0.7, "top_p": 0.95}}
BLOCK_SIZE = 16
SHARED_SHARE = 7 / 8    # of each context, the prefix every request shares
PROMPT_TAIL = 8         # of each context, the prompt's own tokens; the rest until the context is full is generated


@dataclass(frozen=True)
class Spread:
    """Milliseconds: the median and the 10th and 90th percentiles of a phase's steps."""

    median: float
    p10: float
    p90: float

    @classmethod
    def of(cls, nanoseconds: list[int]) -> Spread:
        p10, median, p90 = np.percentile(np.asarray(nanoseconds) / 1e6, [10, 50, 90])
        return cls(float(median), float(p10), float(p90))


@dataclass(frozen=True)
class HostRow:
    pool: int
    batch: int
    context: int
    phases: dict[str, Spread]       # PHASES, and "engine"
    sampler: dict[str, Spread]      # SAMPLERS


# --- the phases, in LLMEngine._step's order --------------------------------------------------------------


def phase_schedule(engine: LLMEngine) -> SchedulerOutput:
    return engine.scheduler.schedule()


def phase_prepare(runner, pool, output: SchedulerOutput) -> None:
    items = output.batch.items
    prefill = [item for item in items if len(item.token_ids) > 1]
    decode = [item for item in items if len(item.token_ids) == 1]
    if items:
        runner._prepare(prefill + decode, len(prefill), pool)


def phase_update(engine: LLMEngine, output: SchedulerOutput, runner_output):
    return engine.scheduler.update_from_output(output, runner_output)


def phase_snapshot(engine: LLMEngine):
    cache = engine.scheduler.cache_state()
    return cache, build_snapshot(engine.scheduler, cache, engine.step_counter, engine.config.allocator)


def phase_events(engine: LLMEngine, output: SchedulerOutput, update, cache, snapshot, times: PhaseTimes) -> StepResult:
    stats = build_stats(engine.scheduler, cache, engine.step_counter, time.time(), output.batch, times,
                        update.num_generated)
    events, kv_events = engine.scheduler.take_events()
    return StepResult(outputs=update.outputs, stats=stats, snapshot=snapshot, events=events, kv_events=kv_events)


def phase_run_log(rows_for: RowBuilder, result: StepResult) -> None:
    rows_for.add(Rows(), LoggedStep.of(result))


def input_runner(num_blocks: int, block_size: int):
    """(a ModelRunner holding only what its input preparation reads, a zero-byte pool of ``num_blocks``)."""
    import torch

    from kvscope.engine.model.model_runner import ModelRunner
    from kvscope.engine.model.step_inputs import StepInputs

    # No model to load: _prepare reads only its step inputs (whose persistent block tables widen to the longest
    # table they are given).
    runner = ModelRunner.__new__(ModelRunner)
    runner.inputs = StepInputs(block_size, 1, torch.device("cpu"))
    return runner, torch.empty((1, 2, num_blocks, block_size, 0, 0))


class PhasedEngine:
    """Steps an engine phase by phase (the functions above), keeping each phase's thread CPU time. It tells no
    observer and reports no aborted request's final output: the bench's workload has neither."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.runner, self.pool = input_runner(engine.num_blocks, engine.block_size)
        self.rows_for = RowBuilder(run_id=0)
        self.times: dict[str, list[int]] = {phase: [] for phase in PHASES}

    def restart_log(self) -> None:
        """A fresh run log: its next frame is a keyframe."""
        self.rows_for = RowBuilder(run_id=0)

    def _timed(self, phase: str, call: Callable, *args):
        start = time.thread_time_ns()
        result = call(*args)
        self.times[phase].append(time.thread_time_ns() - start)
        return result

    def step(self) -> StepResult:
        engine, timed = self.engine, self._timed
        engine.step_counter += 1
        start = time.perf_counter()
        output = timed("schedule", phase_schedule, engine)
        scheduled = time.perf_counter()
        timed("prepare", phase_prepare, self.runner, self.pool, output)
        runner_output = engine.runner.execute(output.batch)     # the forward: not timed
        executed = time.perf_counter()
        update = timed("update", phase_update, engine, output, runner_output)
        updated = time.perf_counter()
        cache, snapshot = timed("snapshot", phase_snapshot, engine)
        times = PhaseTimes(start, scheduled, executed, updated, time.perf_counter())
        result = timed("events", phase_events, engine, output, update, cache, snapshot, times)
        timed("run-log", phase_run_log, self.rows_for, result)
        return result

    def clear(self) -> None:
        for values in self.times.values():
            values.clear()


# --- the workload ----------------------------------------------------------------------------------------


def decoding_engine(pool: int, batch: int, context: int, max_tokens: int, seed: int, tokenizer=None, *,
                    shared_share: float = SHARED_SHARE, prompt_tail: int | None = PROMPT_TAIL) -> PhasedEngine:
    """``batch`` requests decoding with ``context`` tokens of context each, and ``max_tokens`` more to go.

    ``shared_share`` of each context is a prefix they share; then ``prompt_tail`` tokens of each prompt's own
    (None: the rest of the context), and the rest of the context generated before this returns.
    """
    shared = int(context * shared_share) // BLOCK_SIZE * BLOCK_SIZE
    own = context - shared
    tail = own if prompt_tail is None else min(own, prompt_tail)
    needed = -(-shared // BLOCK_SIZE) + batch * -(-(own + max_tokens) // BLOCK_SIZE)
    if needed > pool:
        raise ValueError(f"{batch} requests of {context}+{max_tokens} tokens need {needed} blocks, more than the "
                         f"pool of {pool}: fewer steps, a smaller batch or a larger pool")
    # Every prompt in one step: requests admitted early would otherwise decode while the others wait.
    config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=pool, max_num_seqs=batch,
                          max_num_batched_tokens=max(8_192, batch * tail + shared), seed=seed)
    runner = FakeRunner(config, max_model_len=context + max_tokens + 1, verify=False)
    engine = LLMEngine(config, runner=runner, tokenizer=tokenizer)
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared)]   # byte ids: in every tokenizer's vocabulary
    if shared:      # one short request computes the prefix, so that the others find it cached
        engine.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=own - tail + max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(prefix + [rng.randrange(256) for _ in range(tail)], params)
    while engine.step().stats.num_prefill_tokens:
        pass    # the step after the last prompt chunk decodes every request once
    for _ in range(own - tail - 1):
        engine.step()
    return PhasedEngine(engine)


def measure_cell(pool: int, batch: int, context: int, settings: HostSettings, tokenizer=None) -> dict[str, Spread]:
    max_tokens = 2 * settings.warmup + settings.steps + 4     # nobody finishes while measured
    phased = decoding_engine(pool, batch, context, max_tokens, settings.seed, tokenizer)
    for _ in range(settings.warmup):
        phased.step()
    phased.clear()
    phased.restart_log()
    for _ in range(settings.steps):
        stats = phased.step().stats
        if stats.num_decode_tokens != batch or stats.num_prefill_tokens:
            raise RuntimeError(f"expected {batch} decodes a step, got {stats.num_decode_tokens} "
                               f"(and {stats.num_prefill_tokens} prefill tokens)")
    times = phased.times
    engine_ns = [sum(step) for step in zip(*(times[phase] for phase in ENGINE_PHASES), strict=True)]
    return {phase: Spread.of(times[phase]) for phase in PHASES} | {"engine": Spread.of(engine_ns)}


def time_sampler(batch: int, settings: HostSettings) -> dict[str, Spread]:
    """The Sampler's thread CPU time per call at ``batch`` rows of ``settings.vocab`` logits, one torch thread."""
    import torch

    from kvscope.engine.model.sampler import Sampler, SampleRow

    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # thread CPU time counts the calling thread only
    try:
        generator = torch.Generator().manual_seed(settings.seed)
        logits = torch.randn((batch, settings.vocab), generator=generator)
        result = {}
        for name, knobs in SAMPLERS.items():
            rows = [SampleRow(SamplingParams(**knobs).normalized(), 0, 100 + row) for row in range(batch)]
            sampler = Sampler(settings.seed)
            sampler.sample(logits, rows)    # warm-up
            times = []
            for _ in range(settings.sampler_repeats):
                start = time.thread_time_ns()
                sampler.sample(logits, rows)
                times.append(time.thread_time_ns() - start)
            result[name] = Spread.of(times)
        return result
    finally:
        torch.set_num_threads(threads)


def _sampler_path() -> str:
    """Which path served the sampler on this CPU: the C++ kernels, or the tensor ops where they are not built."""
    from kvscope.kernels import cpu

    return "C++ sampler kernels" if cpu.available() else "tensor ops (no C++ kernels)"


def run_host_bench(settings: HostSettings, progress: Callable[[str], None] | None = None) -> tuple[list[HostRow], str]:
    """Every (pool, batch, context) cell; returns the rows and the tokenizer's name."""
    tokenizer, tokenizer_name = text_tokenizer()
    rows = []
    for batch in settings.batches:
        sampler = time_sampler(batch, settings)
        for pool in settings.pools:
            for context in settings.contexts:
                if progress:
                    progress(f"pool {pool:,}, batch {batch}, context {context}")
                phases = measure_cell(pool, batch, context, settings, tokenizer)
                rows.append(HostRow(pool, batch, context, phases, sampler))
    return rows, tokenizer_name


def _cell(spread: Spread) -> str:
    return f"{spread.median:.2f} ({spread.p10:.2f}-{spread.p90:.2f})"


def format_table(rows: list[HostRow], settings: HostSettings, tokenizer_name: str) -> str:
    columns = [*ENGINE_PHASES, "engine", "run-log", *(f"sampler {name}" for name in SAMPLERS)]
    cells = [[f"{row.pool:,}", str(row.batch), f"{row.context:,}",
              *(_cell(row.phases[name]) for name in (*ENGINE_PHASES, "engine", "run-log")),
              *(_cell(row.sampler[name]) for name in SAMPLERS)] for row in rows]
    header = ["blocks", "batch", "context", *columns]
    title = [
        "kvscope bench host: one decode step's host work by phase, forward excluded; thread CPU ms, "
        "median (p10-p90)",
        f"  {settings.steps} steps a cell after {settings.warmup} warm-up; FakeRunner; text by {tokenizer_name} "
        f"tokenizer; sampler over {settings.vocab:,} logits, one torch thread, {settings.sampler_repeats} calls, "
        f"{_sampler_path()}",
    ]
    return titled_table(title, header, cells, "engine = schedule + prepare + update + snapshot + events, per step; "
                        "run-log is the writer thread's encoding of the step; the sampler depends on the batch only "
                        "(measured once per batch)")


def as_json(rows: list[HostRow]) -> list[dict]:
    def spreads(named: dict[str, Spread]) -> dict:
        return {name: vars(spread) for name, spread in named.items()}

    return [{"bench": "host", "blocks": r.pool, "batch": r.batch, "context": r.context,
             "phases_ms": spreads(r.phases), "sampler_ms": spreads(r.sampler)} for r in rows]
