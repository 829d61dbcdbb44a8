"""The serving benchmark's parts: kvscope's OpenAI-client load generator against a real kvscope serve, and the table
with its kvscope/vLLM ratios."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
from serve_helpers import running_server

from kvscope.app.attach.feed.metrics import parse_metrics
from kvscope.app.bench.serve_bench import Row, ServeBenchSettings, ServerTimes, format_table, scrape
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


def test_the_servers_own_split_of_ttft_covers_exactly_the_run_between_two_scrapes():
    """What the bench reads from /metrics around one rate's run: the means of that run's requests alone (the
    requests before the first scrape do not count), with the queue and the prefill inside the TTFT."""
    prompts = random_prompts(4, 16, vocab_size=49152, seed=2)
    with running_server() as server:
        asyncio.run(run_load(f"{server.url}/v1", "tiny", prompts[:1], output_len=2, rate=math.inf))
        before = scrape(server.url)
        assert before.totals().histogram("ttft").count == 1      # so far: the request above
        result = asyncio.run(run_load(f"{server.url}/v1", "tiny", prompts, output_len=3, rate=math.inf))
        after = scrape(server.url)
    assert after.totals().histogram("ttft").count - 1 == result.completed == 4
    times = ServerTimes.between(before, after)
    assert times.prefill_ms > 0 and times.queue_ms >= 0 and times.ttft_ms >= times.queue_ms + times.prefill_ms - 1
    assert times.ttft_ms <= result.mean_ms("ttft")     # the client's view includes the server's


def test_a_server_without_the_histograms_or_its_page_has_no_split():
    bare = parse_metrics("", 0.0)
    assert ServerTimes.between(bare, bare) is None
    assert scrape("http://127.0.0.1:9") is None        # nothing listens there: no page, no split, no error


def test_the_table_prints_each_sides_ttft_split_when_the_servers_gave_one():
    rows = [Row("kvscope", "vllm bench serve", 1.0, 32, 0, 0.9, 60.0, 140.0, 300.0, 26.0, 116.0, 151.5,
                ServerTimes(142.0, 18.3, 123.6)),
            Row("vllm", "vllm bench serve", 1.0, 32, 0, 0.9, 60.0, 104.0, 150.0, 31.0, 77.0, 108.0,
                ServerTimes(101.6, 0.0, 81.0))]
    table = format_table(rows, ServeBenchSettings(model_dir="m"))
    assert "kvscope      1      152      142       18      124" in table
    assert "vllm         1      108      102        0       81" in table
    assert "the server's split" in table
    assert "the server's split" not in format_table([dataclasses.replace(r, server=None) for r in rows],
                                                  ServeBenchSettings(model_dir="m"))
