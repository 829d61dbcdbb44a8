"""The serving benchmark's parts: kvscope's OpenAI-client load generator against a real kvscope serve, and the table
with its kvscope/vLLM ratios."""

from __future__ import annotations

import asyncio
import math

import pytest
from serve_helpers import running_server

from kvscope.app.bench.serve_bench import Row, ServeBenchSettings, format_table
from kvscope.app.bench.serve_load import random_prompts, run_load


@pytest.mark.parametrize("rate", [math.inf, 50.0])
def test_the_load_generator_measures_every_request_and_token(rate):
    prompts = random_prompts(6, 24, vocab_size=49152, seed=1)
    assert all(len(p) == 24 for p in prompts) and prompts == random_prompts(6, 24, vocab_size=49152, seed=1)
    with running_server() as server:
        result = asyncio.run(run_load(f"{server.url}/v1", "tiny", prompts, output_len=5, rate=rate))
    assert (result.completed, result.failed, result.errors) == (6, 0, [])
    assert result.output_tokens == 30
    assert len(result.ttft_s) == 6 and len(result.itl_s) == 6 * 4      # a chunk per token
    assert result.output_throughput == pytest.approx(30 / result.duration_s)
    assert 0 < result.percentile_ms("ttft", 50) <= result.percentile_ms("ttft", 99)


def test_a_failed_request_is_counted_with_its_reason():
    with running_server() as server:
        result = asyncio.run(run_load(f"{server.url}/v1", "no-such-model", [[1000, 1001]], 3, math.inf))
    assert (result.completed, result.failed) == (0, 1) and "NotFoundError" in result.errors[0]


def test_the_table_prints_both_systems_and_the_ratios():
    rows = [Row("kvscope", "vllm bench serve", 4.0, 32, 0, 2.0, 120.0, 300.0, 900.0, 50.0, 80.0),
            Row("vllm", "vllm bench serve", 4.0, 32, 0, 2.5, 150.0, 200.0, 600.0, 40.0, 60.0)]
    table = format_table(rows, ServeBenchSettings(model_dir="m"))
    assert "client: vllm bench serve" in table
    assert "kvscope      4   32    0    2.00     120.0       300       900       50       80" in table
    assert "rate 4:  output tok/s 0.80x  req/s 0.80x  TTFT p50 1.50x  ITL p50 1.25x" in table
