"""/metrics pages recorded from a real vLLM server: parsing, rates, quantiles, restarts."""

from __future__ import annotations

import re

import pytest
from vllm_fakes import SHARED, timeseries_pages

from kvscope.app.attach.feed.metrics import Histogram, parse_metrics
from kvscope.app.attach.feed.rates import LOG_INTERVAL_S, RateWindow

PAGE = (SHARED / "metrics.txt").read_text()


def series(text: str, name: str, **labels) -> float:
    """A value read straight off the page with a regex: the test's own reading, not kvscope's."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_the_recorded_page_parses_to_its_own_numbers():
    sample = parse_metrics(PAGE, 100.0)
    engine = sample.totals()
    assert sample.model_name == "smollm2" and [e.engine for e in sample.engines] == ["0"]
    assert engine.num_gpu_blocks == 96 and engine.block_size == 32
    assert engine.prefix_cache_queries == series(PAGE, "vllm:prefix_cache_queries_total") == 11660
    assert engine.prefix_cache_hits == series(PAGE, "vllm:prefix_cache_hits_total") == 1920
    assert engine.num_preemptions == 2
    assert engine.generation_tokens == series(PAGE, "vllm:generation_tokens_total")
    assert dict(engine.waiting_by_reason) == {"capacity": 0, "deferred": 0}
    assert dict(engine.finished_by_reason)["length"] == 15
    assert sample.process_start_time == series(PAGE, "process_start_time_seconds")
    ttft = engine.histogram("ttft")
    assert ttft.count == 15 and ttft.bounds[-1] == float("inf")
    assert ttft.counts[ttft.bounds.index(2.5)] == 7


def test_quantiles_interpolate_within_the_bucket_like_prometheus():
    ttft = parse_metrics(PAGE, 0).totals().histogram("ttft")
    # rank 7.5 of 15 lies in (2.5, 5.0], which holds observations 8..11: 2.5 + 2.5 * 0.5 / 4
    assert ttft.quantile(0.5) == pytest.approx(2.8125)
    # rank 14.85 lies in (10, 20], which holds the 15th
    assert ttft.quantile(0.99) == pytest.approx(18.5)
    top = Histogram((1.0, float("inf")), (1.0, 3.0), 3.0, 9.0)
    assert top.quantile(0.99) == 1.0    # past the last finite bound: that bound, flagged by Quantiles


def test_an_empty_histogram_has_no_quantiles():
    assert Histogram((1.0, float("inf")), (0.0, 0.0), 0.0, 0.0).quantile(0.5) is None


def test_rates_average_over_ten_seconds_of_samples():
    window = RateWindow()
    pages = timeseries_pages()
    rates = [window.push(parse_metrics(page, t)) for t, page in pages]
    times = [t for t, _ in pages]
    # At each sample, the rate is the growth since the last sample at least 10 s older, over that time.
    for index in range(12, len(pages)):
        start = max(i for i in range(index) if times[index] - times[i] >= LOG_INTERVAL_S)
        expected = (series(pages[index][1], "vllm:generation_tokens_total")
                    - series(pages[start][1], "vllm:generation_tokens_total")) / (times[index] - times[start])
        assert rates[index].generation_tokens_per_s == pytest.approx(expected)
        assert rates[index].window_s == pytest.approx(times[index] - times[start])


def test_hit_rate_is_hits_over_queries():
    rates = RateWindow().push(parse_metrics(PAGE, 0))
    assert rates.hit_rate == 1920 / 11660
    assert rates.window_hit_rate is None and rates.prompt_tokens_per_s == 0.0


def test_a_restart_restarts_the_window_instead_of_a_negative_rate():
    window = RateWindow()
    busy = parse_metrics(PAGE, 100.0)
    window.push(busy)
    idle = parse_metrics((SHARED / "metrics-idle.txt").read_text(), 103.0)
    rates = window.push(idle)
    assert rates.window_s == 0 and rates.generation_tokens_per_s == 0.0


def test_several_engines_add_up_and_weigh_usage_by_pool():
    # As vLLM writes a two-rank page: each family's rank-1 series right after its rank-0 ones.
    lines = []
    for line in PAGE.splitlines():
        lines.append(line)
        if line.startswith("vllm:") and 'engine="0"' in line:
            twin = line.replace('engine="0"', 'engine="1"')
            lines.append(re.sub(r"^(vllm:kv_cache_usage_perc\S*) 0\.0$", r"\1 0.5", twin))
    both = "\n".join(lines) + "\n"
    sample = parse_metrics(both, 0)
    assert [e.engine for e in sample.engines] == ["0", "1"]
    totals = sample.totals()
    assert totals.prefix_cache_queries == 2 * 11660 and totals.num_gpu_blocks == 192
    assert totals.kv_usage == pytest.approx(0.25)
    assert totals.histogram("ttft").count == 30


def test_recent_quantiles_come_from_the_window_when_it_has_observations():
    window = RateWindow()
    idle = parse_metrics((SHARED / "metrics-idle.txt").read_text(), 0.0)
    window.push(idle)
    rates = window.push(parse_metrics(PAGE, 5.0))
    assert rates.ttft.recent and rates.ttft.count == 15 - int(idle.totals().histogram("ttft").count)
    still = window.push(parse_metrics(PAGE, 20.0))
    assert not still.ttft.recent and still.ttft.count == 15   # nothing new in the window: since start
