"""transformers' built-in continuous batching (the ContinuousBatchingManager behind ``generate_batch``).

``generate_batch`` takes one ``max_new_tokens`` for all prompts, so the bench
drives the manager it wraps directly: one ``add_request`` per request with its
own output length, EOS disabled (-1), and a cache bounded to the workload's KV
budget (left alone it sizes itself from free memory: 60% of RAM on a CPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from time import perf_counter

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvscope.app.bench.hf_static import TransformersRun, sampling_kwargs
from kvscope.app.bench.metrics import RunRecord
from kvscope.app.bench.systems import HF_CB
from kvscope.app.bench.workloads import BenchRequest, Workload

SYSTEM = HF_CB
NO_EOS = -1
RESULT_POLL_S = 1.0


@dataclass(frozen=True)
class ContinuousSettings:
    page_size: int = 256
    max_batch_tokens: int = 512
    max_requests_per_batch: int = 16


def num_pages(kv_cache_tokens: int, page_size: int) -> int:
    return max(1, -(-kv_cache_tokens // page_size))


def continuous_batching_config(settings: ContinuousSettings, pages: int) -> ContinuousBatchingConfig:
    """The manager's config in the installed transformers' words: before page_size, the page was its block_size
    (5.17, where a GPU machine's transformers may still be), and flash attention was never switched on by itself;
    since auto_switch_to_flash exists it is off, so every system runs the same attention."""
    fields = {spec.name for spec in dataclasses.fields(ContinuousBatchingConfig)}
    chosen = asdict(settings) | {"num_blocks": pages, "seed": 0}
    if "page_size" not in fields:
        chosen["block_size"] = chosen.pop("page_size")
    if "auto_switch_to_flash" in fields:
        chosen["auto_switch_to_flash"] = False
    return ContinuousBatchingConfig(**chosen)


class ContinuousBatchRun(TransformersRun):
    """One pass of a workload through a fresh manager."""

    def run(self, workload: Workload, warm_up: BenchRequest) -> RunRecord:
        samples = {r.n for r in workload.requests}
        if len(samples) != 1:
            raise ValueError("hf-cb takes the sample count from its generation config: one n per workload")
        self.stock_attention()
        pages = num_pages(workload.kv_cache_tokens, self.settings.page_size)
        manager = self.model.init_continuous_batching(
            generation_config=self._generation_config(workload, samples.pop()),
            continuous_batching_config=continuous_batching_config(self.settings, pages),
        )
        manager.start()
        try:
            self._drain(manager, [self._submit(manager, warm_up, record_timestamps=False)], warm_up.n)
            start = perf_counter()
            ids = [self._submit(manager, request, record_timestamps=True) for request in workload.requests]
            results = self._drain(manager, ids, workload.requests[0].n)
            wall = perf_counter() - start
            resolved = manager.continuous_batching_config
        finally:
            manager.stop(block=True)
            manager.destroy()
        token_times = [[t - start for t in results[rid].timestamps or ()] for rid in ids]
        settings = asdict(self.settings) | {"num_blocks": resolved.num_blocks,
                                            "kv_cache_tokens": resolved.num_blocks * self.settings.page_size,
                                            "attention": self.model.config._attn_implementation}
        return RunRecord(
            system=SYSTEM, settings=settings, wall_s=wall, num_prompt_tokens=workload.num_prompt_tokens,
            num_output_tokens=sum(len(r.generated_tokens) for r in results.values()), token_times=token_times,
            outputs=[tuple(results[rid].generated_tokens) for rid in ids],
        )

    def _generation_config(self, workload: Workload, n: int) -> GenerationConfig:
        return GenerationConfig(
            num_return_sequences=n, max_new_tokens=max(r.max_tokens for r in workload.requests),
            eos_token_id=NO_EOS, pad_token_id=self.pad_token_id, **sampling_kwargs(workload.temperature),
        )

    @staticmethod
    def _submit(manager, request: BenchRequest, record_timestamps: bool) -> str:
        request_id = manager.add_request(list(request.prompt_token_ids), max_new_tokens=request.max_tokens,
                                         record_timestamps=record_timestamps, eos_token_id=NO_EOS)
        if request_id is None:
            raise RuntimeError("the continuous batching manager refused a request")
        return request_id

    @staticmethod
    def _drain(manager, request_ids: list[str], n: int) -> dict:
        """Wait for every request and its n-1 forked children; results by request id."""
        expected = len(request_ids) * n
        results: dict = {}
        while len(results) < expected:
            result = manager.get_result(timeout=RESULT_POLL_S)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"the continuous batching loop stopped with {expected - len(results)} "
                                       "requests unfinished")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
                results[result.request_id] = result
        return results
