"""vLLM's Prometheus metrics, kept from kvscope's own engine steps, so a dashboard built for vLLM works unchanged.

Names, help texts, labels (``engine``, ``model_name``) and histogram buckets are vLLM 0.32's, wherever kvscope
has the quantity; ``vllm:num_requests_swapped`` is vLLM V0's name (kvscope really swaps). Meanings follow
vLLM's: prompt tokens are counted once per request, when its first token is out (cached ones included, as
vLLM counts them); generation tokens are every token sampled; the latency histograms come from each request's
own timestamps (arrival, first scheduled, first token, finished). The page also carries prometheus_client's
process and Python collectors, as vLLM's does (``process_start_time_seconds`` tells a watcher about restarts).

It is an engine observer: ``step(result)`` runs on the engine thread, inside the step, so it only adds.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    gc_collector,
    generate_latest,
    platform_collector,
    process_collector,
)

LABELS = ("engine", "model_name")
FINISH_REASONS = ("stop", "length", "abort", "error")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50 … up to ``limit``: vLLM's token-count buckets for a given max_model_len."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class ServeMetrics:
    def __init__(self, model_name: str, max_model_len: int, cache_config: dict[str, str]) -> None:
        self.registry = registry = CollectorRegistry()
        for collector in (process_collector.ProcessCollector, platform_collector.PlatformCollector,
                          gc_collector.GCCollector):
            collector(registry=registry)
        self.labels = {"engine": "0", "model_name": model_name}

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, LABELS, registry=registry).labels(**self.labels)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, LABELS, registry=registry).labels(**self.labels)

        def histogram(name: str, text: str, buckets) -> Histogram:
            return Histogram(name, text, LABELS, buckets=buckets, registry=registry).labels(**self.labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.swapped = gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.queries = counter("vllm:prefix_cache_queries",
                               "Prefix cache queries, in terms of number of queried tokens.")
        self.hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=registry)
        self.finished = {reason: success.labels(**self.labels, finished_reason=reason) for reason in FINISH_REASONS}
        tokens = one_two_five(max_model_len)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", tokens)
        self.iteration = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                   ITERATION_BUCKETS)
        self.request_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             PHASE_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", PHASE_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", PHASE_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", PHASE_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", PHASE_BUCKETS)
        self.request_preemptions = histogram("vllm:request_num_preemptions",
                                             "Histogram of the number of times a request was preempted.",
                                             PREEMPTION_BUCKETS)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", ("engine", *cache_config),
              registry=registry).labels(engine="0", **cache_config).set(1)
        self._lock = threading.Lock()
        self._last_token_time: dict[str, float] = {}     # request id -> when its latest token came out
        self._previous = None                            # the previous step's StepStats, for counter deltas
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0}
        self.latest = None                               # the latest StepStats, for the status line

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # --- the engine's observer interface -------------------------------------------------------------------

    def request_added(self, request_id: str, prompt_text: str, num_prompt_tokens: int, n: int) -> None:
        self.request_n.observe(n)

    def step(self, result) -> None:
        stats = result.stats
        with self._lock:
            self._gauges_and_counters(stats)
            for output in result.outputs:
                self._request(output, stats.time)
            self.latest = stats

    def _gauges_and_counters(self, stats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_usage)
        previous = self._previous
        for counter, name in ((self.queries, "prefix_cache_queries"), (self.hits, "prefix_cache_hits"),
                              (self.preemptions, "num_preemptions")):
            delta = getattr(stats, name) - (getattr(previous, name) if previous is not None else 0)
            if delta > 0:
                counter.inc(delta)
        self._previous = stats
        generated = stats.num_generated_tokens
        if generated:
            self.generation_tokens.inc(generated)
            self.totals["generation_tokens"] += generated
        if stats.num_prefill_tokens or stats.num_decode_tokens:
            self.iteration.observe(stats.num_prefill_tokens + stats.num_decode_tokens)

    def _request(self, output, now: float) -> None:
        request_id = output.request_id
        if output.new_token_ids:
            last = self._last_token_time.get(request_id)
            if last is None:
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                self.totals["prompt_tokens"] += len(output.prompt_token_ids)
            else:
                self.itl.observe(now - last)
            self._last_token_time[request_id] = now
        if output.finished:
            self._last_token_time.pop(request_id, None)
            self._finished(output)

    def _finished(self, output) -> None:
        self.finished[str(output.finish_reason)].inc()
        num_generated = sum(len(sample.token_ids) for sample in output.samples)
        self.request_prompt.observe(len(output.prompt_token_ids))
        self.request_generation.observe(num_generated)
        self.request_preemptions.observe(output.num_preemptions)
        times = output.metrics
        arrival, scheduled, first, done = (times.arrival_time, times.first_scheduled_time, times.first_token_time,
                                           times.finished_time)
        # Each span between two moments of the request's life, observed when both happened (an aborted request
        # may never have been scheduled or have made a token).
        spans = ((self.e2e, arrival, done), (self.queue, arrival, scheduled), (self.inference, scheduled, done),
                 (self.ttft, arrival, first), (self.prefill, scheduled, first), (self.decode, first, done))
        for histogram, start, end in spans:
            if start is not None and end is not None:
                histogram.observe(end - start)
        if first is not None and done is not None and len(output.token_ids) > 1:
            self.tpot.observe((done - first) / (len(output.token_ids) - 1))
