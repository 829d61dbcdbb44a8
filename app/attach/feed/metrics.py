"""One scrape of a vLLM server's ``/metrics`` page, parsed by prometheus_client into immutable records.

vLLM labels every series with ``engine`` (the data-parallel rank) and
``model_name``; a record per engine keeps the ranks apart, and ``totals`` adds
them up for the server-wide panels. Only the series kvscope shows are kept:
the page carries hundreds more (HTTP, GC, per-request parameter histograms),
and lines of other families are dropped before parsing, which halves its cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvscope.app.attach.feed.limits import (
    MAX_BUCKETS,
    MAX_COUNT,
    MAX_LABELS,
    MAX_RANKS,
    MAX_REQUESTS,
    MAX_TEXT,
    pool_problem,
)

GAUGES = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
# prometheus_client names a counter family without its "_total" suffix.
COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:num_preemptions": "num_preemptions",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:e2e_request_latency_seconds": "e2e",
    "vllm:request_queue_time_seconds": "queue",
    "vllm:request_prefill_time_seconds": "prefill",
}
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
FINISHED_BY_REASON = "vllm:request_success"
CACHE_CONFIG = "vllm:cache_config_info"
PROCESS_START = "process_start_time_seconds"
CORE_FAMILIES = frozenset({*GAUGES, *COUNTERS, CACHE_CONFIG})
_KEPT_PREFIXES = ("vllm:", "# HELP vllm:", "# TYPE vllm:", PROCESS_START, f"# HELP {PROCESS_START}",
                  f"# TYPE {PROCESS_START}")


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts, as Prometheus publishes them; ``bounds`` ends with +Inf."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    count: float
    sum: float

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made since ``earlier`` (the whole histogram when it does not match)."""
        if earlier is None or earlier.bounds != self.bounds or earlier.count > self.count:
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts)),
                         self.count - earlier.count, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket holding rank q; None when empty.

        Past the last finite bound the answer is that bound (the true value is larger).
        """
        total = self.counts[-1] if self.counts else 0.0
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.counts):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                if cumulative == below:
                    return bound
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower


@dataclass(frozen=True)
class EngineMetrics:
    """One engine (data-parallel rank) at one scrape."""

    engine: str
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0               # blocks held by requests / usable blocks (0..1)
    prefix_cache_queries: float = 0.0   # cumulative, in tokens
    prefix_cache_hits: float = 0.0
    num_preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    waiting_by_reason: tuple[tuple[str, int], ...] = ()
    finished_by_reason: tuple[tuple[str, int], ...] = ()
    histograms: tuple[tuple[str, Histogram], ...] = ()
    cache_config: tuple[tuple[str, str], ...] = ()

    def histogram(self, key: str) -> Histogram | None:
        return dict(self.histograms).get(key)

    @property
    def num_gpu_blocks(self) -> int | None:
        return _int_or_none(dict(self.cache_config).get("num_gpu_blocks"))

    @property
    def block_size(self) -> int | None:
        return _int_or_none(dict(self.cache_config).get("block_size"))


@dataclass(frozen=True)
class MetricsSample:
    time: float                         # time.time() when the page was read
    engines: tuple[EngineMetrics, ...]
    model_name: str | None = None
    process_start_time: float | None = None   # changes when the server restarts
    text: str = field(default="", repr=False, compare=False)   # the page as read, for checks
    families: frozenset[str] = frozenset()    # the series of CORE_FAMILIES the page has

    def engine(self, label: str) -> EngineMetrics | None:
        return next((e for e in self.engines if e.engine == label), None)

    def totals(self) -> EngineMetrics:
        """Every engine added up (the server as its 10-second log line sees it)."""
        if len(self.engines) == 1:
            return self.engines[0]
        return _add_engines(self.engines)


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "None") else None
    except ValueError:
        return None


def is_vllm_page(text: str) -> bool:
    return "vllm:" in text


def _kept_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith(_KEPT_PREFIXES)) + "\n"


def parse_metrics(text: str, now: float) -> MetricsSample:
    """Parse a /metrics page. Raises ValueError when it cannot be read, whatever is wrong with it."""
    try:
        return _parse(text, now)
    except ValueError:
        raise
    except Exception as exc:   # a missing label, a value no int holds: the page is bad, never the thread
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


def _parse(text: str, now: float) -> MetricsSample:
    engines: dict[str, dict] = {}
    families: set[str] = set()
    model_name, process_start = None, None
    for family in text_string_to_metric_families(_kept_lines(text)):
        if family.name == PROCESS_START:
            process_start = family.samples[0].value if family.samples else None
            continue
        # A page without "# TYPE" lines leaves counters "untyped", named with their "_total".
        name = family.name.removesuffix("_total") if family.type == "unknown" else family.name
        for sample in family.samples:
            label = sample.labels.get("engine", "0")[:MAX_TEXT]
            model_name = model_name or sample.labels.get("model_name")
            if len(engines) > MAX_RANKS and label not in engines:
                raise ValueError(f"more than {MAX_RANKS} engines")
            _add_sample(engines.setdefault(label, {"engine": label}), name, sample)
            families.add(name)
    return MetricsSample(now, tuple(_engine_record(fields) for _, fields in sorted(engines.items())),
                         model_name[:MAX_TEXT] if model_name else None, process_start, text,
                         frozenset(families) & CORE_FAMILIES)


def _add_sample(fields: dict, family: str, sample) -> None:
    if family in GAUGES:
        fields[GAUGES[family]] = sample.value
    elif family in COUNTERS and sample.name.endswith("_total"):
        fields[COUNTERS[family]] = sample.value
    elif family == WAITING_BY_REASON:
        fields.setdefault("waiting_by_reason", {})[sample.labels.get("reason", "?")[:MAX_TEXT]] = _count(sample)
    elif family == FINISHED_BY_REASON and sample.name.endswith("_total"):
        reason = sample.labels.get("finished_reason", "?")[:MAX_TEXT]
        fields.setdefault("finished_by_reason", {})[reason] = _count(sample)
    elif family in HISTOGRAMS:
        parts = fields.setdefault("histogram_parts", {}).setdefault(HISTOGRAMS[family], {"buckets": []})
        suffix = sample.name[len(family):]
        if suffix == "_bucket":
            parts["buckets"].append((float(sample.labels["le"]), sample.value))
        elif suffix in ("_count", "_sum"):
            parts[suffix[1:]] = sample.value
    elif family == CACHE_CONFIG:
        fields["cache_config"] = tuple(sorted((k, v) for k, v in sample.labels.items()
                                              if k not in ("engine", "model_name")))


def _count(sample) -> int:
    if not 0 <= sample.value <= MAX_COUNT:    # also false for NaN
        raise ValueError(f"{sample.name} {sample.value:g} is not a count")
    return int(sample.value)


def _capped(counts: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """The MAX_LABELS largest, by name; any others summed in one "(N more)" row, so a server that invents
    labels cannot grow what is kept per sample."""
    if len(counts) <= MAX_LABELS:
        return tuple(sorted(counts.items()))
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    kept, rest = ranked[:MAX_LABELS - 1], ranked[MAX_LABELS - 1:]
    return (*sorted(kept), (f"({len(rest):,} more)", sum(count for _, count in rest)))


def _engine_record(fields: dict) -> EngineMetrics:
    histograms = []
    for key, parts in sorted(fields.pop("histogram_parts", {}).items()):
        buckets = sorted(parts["buckets"])
        histograms.append((key, Histogram(tuple(b for b, _ in buckets), tuple(c for _, c in buckets),
                                          parts.get("count", 0.0), parts.get("sum", 0.0))))
    for name in ("waiting_by_reason", "finished_by_reason"):
        if name in fields:
            fields[name] = _capped(fields[name])
    for name in ("num_running", "num_waiting"):
        if name in fields:
            if not 0 <= fields[name] <= MAX_REQUESTS:
                raise ValueError(f"{name} {fields[name]:g} is not a plausible count")
            fields[name] = int(fields[name])
    return EngineMetrics(histograms=tuple(histograms), **fields)


def _sum_pairs(groups) -> tuple:
    merged: dict = {}
    for pairs in groups:
        for key, value in pairs:
            merged[key] = merged.get(key, 0) + value
    return tuple(sorted(merged.items()))


def _add_engines(engines: tuple[EngineMetrics, ...]) -> EngineMetrics:
    def total(name: str):
        return sum(getattr(e, name) for e in engines)

    histograms: dict[str, Histogram] = {}
    for engine in engines:
        for key, histogram in engine.histograms:
            seen = histograms.get(key)
            histograms[key] = histogram if seen is None or seen.bounds != histogram.bounds else Histogram(
                seen.bounds, tuple(a + b for a, b in zip(seen.counts, histogram.counts)),
                seen.count + histogram.count, seen.sum + histogram.sum)
    blocks = sum(e.num_gpu_blocks or 0 for e in engines)
    # Usage is a share of each engine's own pool: weigh it by pool size.
    usage = sum(e.kv_usage * (e.num_gpu_blocks or 0) for e in engines) / blocks if blocks else \
        total("kv_usage") / len(engines)
    return EngineMetrics(
        engine="all", num_running=total("num_running"), num_waiting=total("num_waiting"),
        kv_usage=usage,
        **{name: total(name) for name in COUNTERS.values()},
        waiting_by_reason=_sum_pairs(e.waiting_by_reason for e in engines),
        finished_by_reason=_sum_pairs(e.finished_by_reason for e in engines),
        histograms=tuple(sorted(histograms.items())),
        cache_config=(("block_size", str(engines[0].block_size)), ("num_gpu_blocks", str(blocks))),
    )


def sample_problem(sample: MetricsSample, previous: MetricsSample | None = None) -> str | None:
    """Why ``sample`` is not a plausible vLLM page (coming after ``previous``), or None. Its numbers must be
    counts and fractions in range, its pool drawable, and the series the previous page had still there: a
    page whose counters vanish is garbage, not a restarted server."""
    if not 1 <= len(sample.engines) <= MAX_RANKS:
        return f"{len(sample.engines):,} engines is outside 1..{MAX_RANKS}"
    for engine in sample.engines:
        problem = pool_problem(engine.num_gpu_blocks, engine.block_size, len(sample.engines)) or \
            _number_problem(engine)
        if problem:
            return f"engine {engine.engine}: {problem}"
    if previous is not None:
        vanished = previous.families - sample.families
        if vanished:
            return f"series it had before are gone ({', '.join(sorted(vanished))})"
    return None


def _number_problem(engine: EngineMetrics) -> str | None:
    for name in COUNTERS.values():
        value = getattr(engine, name)
        if not 0 <= value <= MAX_COUNT:     # also false for NaN
            return f"{name} {value:g} is not a plausible count"
    if not 0 <= engine.kv_usage <= 1.0 + 1e-6:
        return f"kv_cache_usage_perc {engine.kv_usage:g} is not a fraction"
    for key, histogram in engine.histograms:
        if len(histogram.bounds) > MAX_BUCKETS:
            return f"the {key} histogram has {len(histogram.bounds):,} buckets (at most {MAX_BUCKETS})"
        if not all(0 <= count <= MAX_COUNT for count in (*histogram.counts, histogram.count)):
            return f"the {key} histogram has counts that are not counts"
    return None
