"""An OpenAI-client load generator for a serving benchmark, for machines without vLLM's own client.

It measures what `vllm bench serve` measures, the same way: requests arrive as a Poisson process at the
given rate (all at once for ``inf``), each streams /v1/completions with random token-id prompts of a fixed
length and a fixed number of output tokens (EOS ignored, greedy); TTFT is the time to the first chunk with a
choice, ITL the gap between chunks after it, output tokens come from the usage chunk, and throughput is over
the wall time from the first arrival to the last reply.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import openai

REQUEST_TIMEOUT_S = 600.0


@dataclass
class LoadResult:
    rate: float
    num_requests: int
    duration_s: float = 0.0
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def percentile_ms(self, name: str, q: float) -> float | None:
        values = getattr(self, f"{name}_s")
        return float(np.percentile(values, q)) * 1000 if values else None

    def mean_ms(self, name: str) -> float | None:
        values = getattr(self, f"{name}_s")
        return float(np.mean(values)) * 1000 if values else None

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


def random_prompts(count: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts, as vLLM's random dataset makes them (ids drawn uniformly, away from the special ones)."""
    rng = np.random.default_rng(seed)
    low = min(1000, vocab_size // 2)
    return [rng.integers(low, vocab_size, size=input_len).tolist() for _ in range(count)]


async def run_load(base_url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                   seed: int = 0, api_key: str = "kvscope-bench") -> LoadResult:
    result = LoadResult(rate, len(prompts))
    arrivals = random.Random(seed)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(_one(client, model, prompt, output_len, result)))
            if not math.isinf(rate):
                await asyncio.sleep(arrivals.expovariate(rate))
        await asyncio.gather(*tasks)
        result.duration_s = time.perf_counter() - start
    return result


async def _one(client: openai.AsyncOpenAI, model: str, prompt: list[int], output_len: int,
               result: LoadResult) -> None:
    sent = time.perf_counter()
    last = None
    tokens = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                if last is None:
                    result.ttft_s.append(now - sent)
                else:
                    result.itl_s.append(now - last)
                last = now
            elif chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.OpenAIError as exc:
        result.failed += 1
        result.errors.append(f"{type(exc).__name__}: {exc}")
        return
    if last is None:
        result.failed += 1
        result.errors.append("no chunk with a choice came back")
        return
    result.completed += 1
    result.output_tokens += tokens if tokens is not None else 0
