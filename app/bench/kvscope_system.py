"""kvscope's own engine as a bench system: paged, contiguous, and paged without prefix caching.

Every variant gets the workload's KV budget in blocks and its max_model_len, so
the contiguous allocator reserves what a deployer would set for that workload.
Each timed run is one run in the run log (source "bench"), recorded as every run is: a logger
attached as an engine observer once the warm-up is done, so warm-up steps are not logged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

from kvscope.app.bench.metrics import RunRecord, engine_overhead
from kvscope.app.bench.systems import CONTIGUOUS, PAGED, PAGED_NO_PREFIX
from kvscope.engine import EngineConfig, SamplingParams

# The engine overhead's target is stated at this running batch.
OVERHEAD_BATCH = 64


@dataclass(frozen=True)
class KvscopeVariant:
    name: str
    allocator: str = "paged"
    enable_prefix_caching: bool = True


VARIANTS = {v.name: v for v in (
    KvscopeVariant(PAGED),
    KvscopeVariant(CONTIGUOUS, allocator="contiguous", enable_prefix_caching=False),
    KvscopeVariant(PAGED_NO_PREFIX, enable_prefix_caching=False),
)}


def engine_config(variant: KvscopeVariant, workload, *, model: str, device: str, dtype: str,
                  block_size: int | None = None, max_num_batched_tokens: int | None = None,
                  cpu_threads_bind: str = "none") -> EngineConfig:
    """The engine for ``workload``: its KV budget and max_model_len; block size and step budget the engine's
    defaults unless given (the bench's matched settings)."""
    defaults = EngineConfig()
    block_size = block_size or defaults.block_size
    return EngineConfig(
        model=model, device=device, dtype=dtype, block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens or defaults.max_num_batched_tokens,
        cpu_threads_bind=cpu_threads_bind,
        num_blocks=-(-workload.kv_cache_tokens // block_size), max_model_len=workload.max_model_len,
        preemption_mode=workload.preemption_mode, allocator=variant.allocator,
        enable_prefix_caching=variant.enable_prefix_caching,
    )


def sampling_params(request, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(n=request.n, max_tokens=request.max_tokens, temperature=temperature,
                          seed=seed if temperature > 0 else None, ignore_eos=True,
                          detokenize=False)


class _StepTally:
    """Folds step results into the figures a RunRecord needs."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.token_times: dict[str, list[float]] = {}
        self.tokens_so_far: dict[str, int] = {}
        self.token_ids: dict[str, tuple[int, ...]] = {}   # sample 0's tokens so far
        self.batch_sizes: list[int] = []
        self.step_shapes: list[tuple[int, int]] = []
        self.used_slots = self.reserved_slots = self.prefill_tokens = 0
        self.step_s = self.forward_s = 0.0
        self.full_batch_step_s = self.full_batch_forward_s = 0.0

    def add(self, result, now: float) -> None:
        stats = result.stats
        num_tokens = stats.num_prefill_tokens + stats.num_decode_tokens
        generated = sum(self._add_output(output, now - self.start) for output in result.outputs)
        if num_tokens:
            self.step_shapes.append((num_tokens, generated))
            self.batch_sizes.append(stats.num_running)
        self.prefill_tokens += stats.num_prefill_tokens
        self.step_s += stats.duration
        self.forward_s += stats.forward_duration
        if stats.num_running >= OVERHEAD_BATCH:
            self.full_batch_step_s += stats.duration
            self.full_batch_forward_s += stats.forward_duration
        for view in result.snapshot.requests:
            self.used_slots += view.used_slots
            self.reserved_slots += view.reserved_slots

    def _add_output(self, output, elapsed: float) -> int:
        """Tokens this step gave the request, over all its samples; records sample 0's token times."""
        total = sum(len(s.token_ids) for s in output.samples) if output.samples else len(output.token_ids)
        new = total - self.tokens_so_far.get(output.request_id, 0)
        self.tokens_so_far[output.request_id] = total
        self.token_ids[output.request_id] = output.token_ids
        self.token_times.setdefault(output.request_id, []).extend([elapsed] * len(output.new_token_ids))
        return new


class KvscopeRun:
    """One pass of a workload through a fresh engine.

    ``make_engine(config)`` builds the engine (the real model, or a FakeRunner in
    tests); ``open_log(engine)`` starts recording it (``runlog.record_run``) and returns the logger.
    """

    def __init__(self, variant: KvscopeVariant, make_engine: Callable,
                 open_log: Callable | None = None) -> None:
        self.variant = variant
        self.make_engine = make_engine
        self.open_log = open_log

    def run(self, workload, warm_up, config: EngineConfig) -> RunRecord:
        engine = self.make_engine(config)
        engine.generate([list(warm_up.prompt_token_ids)],
                        sampling_params(warm_up, workload.temperature, seed=0))
        before = engine.step().stats  # an idle step: the cumulative counters after the warm-up
        log = self.open_log(engine) if self.open_log else None
        try:
            record, after = self._timed(engine, workload)
        except BaseException:
            if log is not None:
                log.close("crashed")
            raise
        if log is not None:
            log.close()
        record.preemptions = after.num_preemptions - before.num_preemptions
        record.extra["prefix_cache_hit_tokens"] = after.prefix_cache_hits - before.prefix_cache_hits
        record.settings = {"allocator": config.allocator, "prefix_caching": config.enable_prefix_caching,
                           "num_blocks": engine.num_blocks, "block_size": config.block_size,
                           "max_model_len": engine.max_model_len, "preemption_mode": config.preemption_mode,
                           "max_num_seqs": config.max_num_seqs,
                           "max_num_batched_tokens": config.max_num_batched_tokens}
        return record

    def _timed(self, engine, workload):
        """(the record, the last step's stats)."""
        start = perf_counter()
        order = []
        for index, request in enumerate(workload.requests):
            prompt = list(request.prompt_token_ids)
            params = sampling_params(request, workload.temperature, seed=index)
            order.append(engine.add_request(prompt, params))
        tally = _StepTally(start)
        result = None
        while engine.has_unfinished_requests():
            result = engine.step()
            tally.add(result, perf_counter())
        wall = perf_counter() - start
        record = RunRecord(
            system=self.variant.name, settings={}, wall_s=wall, num_prompt_tokens=workload.num_prompt_tokens,
            num_output_tokens=sum(tally.tokens_so_far.values()),
            token_times=[tally.token_times.get(rid, []) for rid in order], batch_sizes=tally.batch_sizes,
            kv_used_slots=tally.used_slots, kv_reserved_slots=tally.reserved_slots,
            prefill_tokens_computed=tally.prefill_tokens, step_shapes=tally.step_shapes,
            step_s=tally.step_s, forward_s=tally.forward_s,
            outputs=[tally.token_ids.get(rid, ()) for rid in order],
            extra={f"engine_overhead_at_{OVERHEAD_BATCH}": engine_overhead(tally.full_batch_forward_s,
                                                                          tally.full_batch_step_s)},
        )
        return record, (result.stats if result is not None else engine.step().stats)


def run_alone(engine, workload, sample) -> dict[int, list[int]]:
    """Greedy tokens of each sampled request run by itself through ``engine`` (a fresh one: nothing cached)."""
    alone = {}
    for index, tokens in zip(sample.indices, sample.tokens, strict=True):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        [output] = engine.generate([list(workload.requests[index].prompt_token_ids)], params)
        alone[index] = list(output.token_ids)
    return alone
