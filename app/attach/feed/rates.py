"""Rates and latency quantiles from successive /metrics samples.

vLLM's own log line ("Avg prompt throughput: … tokens/s") divides the tokens
counted since its previous line by the seconds since then, every
``VLLM_LOG_STATS_INTERVAL`` (10 s). The same average here slides: each sample's
rate is the counter's growth over the latest ten seconds of samples (or over
all samples, while fewer than ten seconds have been seen), divided by the time
between the two samples. Counters restart from zero when the server does; the
window then restarts too, so a restart never shows as a negative rate.

TTFT and inter-token latency come from histogram buckets: the observations of
the same window when it has any, else everything since the server started (the
record says which), interpolated within a bucket as Prometheus'
``histogram_quantile`` does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvscope.app.attach.feed.metrics import EngineMetrics, MetricsSample

LOG_INTERVAL_S = 10.0
QUANTILES = (0.5, 0.99)


@dataclass(frozen=True)
class Quantiles:
    p50: float
    p99: float
    count: int              # observations the quantiles come from
    recent: bool            # True: the latest window; False: since the server started
    p99_open: bool = False  # p99 lies past the last finite bucket: the true value is larger


@dataclass(frozen=True)
class ServerRates:
    window_s: float                     # seconds the rates are averaged over (0 before two samples)
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    hit_rate: float | None              # hits / queries since the server started; None before any query
    window_hit_rate: float | None       # the same over the window
    num_preemptions: int                # since the server started
    window_preemptions: int
    ttft: Quantiles | None = None
    itl: Quantiles | None = None


def _ratio(hits: float, queries: float) -> float | None:
    return hits / queries if queries > 0 else None


def quantiles_of(latest: EngineMetrics, earliest: EngineMetrics | None, key: str) -> Quantiles | None:
    histogram = latest.histogram(key)
    if histogram is None:
        return None
    recent = histogram.minus(earliest.histogram(key) if earliest is not None else None)
    use_recent = earliest is not None and recent is not histogram and recent.count > 0
    chosen = recent if use_recent else histogram
    p50, p99 = (chosen.quantile(q) for q in QUANTILES)
    if p50 is None:
        return None
    finite = [b for b in chosen.bounds if b != float("inf")]
    return Quantiles(p50, p99, int(chosen.count), use_recent, bool(finite) and p99 >= finite[-1])


class RateWindow:
    """Keeps the samples of the latest LOG_INTERVAL_S and turns them into ServerRates."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._samples: deque[tuple[float, EngineMetrics]] = deque()

    def clear(self) -> None:
        self._samples.clear()

    def push(self, sample: MetricsSample) -> ServerRates:
        totals = sample.totals()
        if self._samples and _went_back(self._samples[-1][1], totals):
            self._samples.clear()       # the server restarted: its counters did
        self._samples.append((sample.time, totals))
        # Keep the newest sample at least interval_s old, so the window always spans a whole interval.
        while len(self._samples) > 2 and sample.time - self._samples[1][0] >= self.interval_s:
            self._samples.popleft()
        return self._rates()

    def _rates(self) -> ServerRates:
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        span = t1 - t0
        earliest = first if span > 0 else None

        def rate(name: str) -> float:
            return (getattr(last, name) - getattr(first, name)) / span if span > 0 else 0.0

        return ServerRates(
            window_s=span, prompt_tokens_per_s=rate("prompt_tokens"),
            generation_tokens_per_s=rate("generation_tokens"),
            hit_rate=_ratio(last.prefix_cache_hits, last.prefix_cache_queries),
            window_hit_rate=_ratio(last.prefix_cache_hits - first.prefix_cache_hits,
                                   last.prefix_cache_queries - first.prefix_cache_queries) if span > 0 else None,
            num_preemptions=int(last.num_preemptions),
            window_preemptions=int(last.num_preemptions - first.num_preemptions),
            ttft=quantiles_of(last, earliest, "ttft"), itl=quantiles_of(last, earliest, "itl"),
        )


def _went_back(before: EngineMetrics, after: EngineMetrics) -> bool:
    return (after.prompt_tokens < before.prompt_tokens or after.generation_tokens < before.generation_tokens
            or after.prefix_cache_queries < before.prefix_cache_queries)
