"""What watchers of kvscope serve read matches the engine: /metrics (parsed by kvscope attach's own parser) against
the engine's StepStats and the responses' usage; `kvscope attach`'s probe and data source against the engine's
pool size and prefix-cache hit rate."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import client, running_server, tiny_engine, wait_until

from kvscope.app.attach.feed.metrics import parse_metrics
from kvscope.app.attach.feed.server import make_client, probe_server
from kvscope.app.attach.feed.source import AttachSource

SHARED_PREFIX = " ".join(f"fact{i}" for i in range(30))     # two full blocks of 16 tokens, shared by all


class StepRecorder:
    """An engine observer keeping every StepResult."""

    def __init__(self) -> None:
        self.results = []

    def request_added(self, *args) -> None:
        pass

    def step(self, result) -> None:
        self.results.append(result)


def busy_load(server, count: int = 6, max_tokens: int = 60) -> list:
    """``count`` concurrent completions sharing a prefix, more than the small pool holds at once."""
    api = client(server)

    def one(index: int):
        return api.completions.create(model="tiny", prompt=f"{SHARED_PREFIX} question {index}",
                                      max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


@pytest.fixture(scope="module")
def loaded():
    engine = tiny_engine(num_blocks=24)
    recorder = StepRecorder()
    engine.add_observer(recorder)
    with running_server(engine) as server:
        replies = busy_load(server)
        wait_until(lambda: not engine.has_unfinished_requests())
        yield engine, server, recorder, replies


def test_metrics_match_the_engines_step_stats_and_the_replies(loaded):
    engine, server, recorder, replies = loaded
    page = httpx.get(f"{server.url}/metrics").text
    metrics = parse_metrics(page, 0.0).totals()
    last = recorder.results[-1].stats
    assert last.num_preemptions > 0 and last.prefix_cache_hits > 0, "the load should preempt and hit the cache"
    assert (metrics.num_running, metrics.num_waiting, metrics.kv_usage) == (last.num_running, last.num_waiting,
                                                                             last.kv_usage)
    assert metrics.prefix_cache_queries == last.prefix_cache_queries
    assert metrics.prefix_cache_hits == last.prefix_cache_hits
    assert metrics.num_preemptions == last.num_preemptions
    assert metrics.prompt_tokens == sum(reply.usage.prompt_tokens for reply in replies)
    assert metrics.generation_tokens == sum(reply.usage.completion_tokens for reply in replies) == 6 * 60
    assert dict(metrics.finished_by_reason) == {"stop": 0, "length": 6, "abort": 0, "error": 0}
    for name in ("ttft", "e2e", "queue"):
        assert metrics.histogram(name).count == 6
    assert metrics.histogram("itl").count == 6 * 59
    assert (metrics.num_gpu_blocks, metrics.block_size) == (24, 16)
    assert f'vllm:num_requests_swapped{{engine="0",model_name="tiny"}} {float(last.num_swapped)}' in page
    assert "process_start_time_seconds" in page     # how a watcher tells a restart


def test_the_status_line_reads_like_vllms(loaded):
    from kvscope.app.serve.status_log import StatusLine

    engine, server, recorder, replies = loaded
    line = StatusLine(server.metrics, "cpu", show_swapped=False)
    line._last_totals = {"prompt_tokens": 0, "generation_tokens": 0}   # the whole run as one interval
    text = line.line(line._last_time + 10.0)
    pattern = (r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
               r"Running: 0 reqs, Waiting: 0 reqs, CPU KV cache usage: 0\.0%, Prefix cache hit rate: ([\d.]+)%")
    match = re.fullmatch(pattern, text)
    assert match, text
    assert float(match.group(1)) == pytest.approx(360 / 10.0, abs=0.05)
    last = recorder.results[-1].stats
    assert float(match.group(2)) == pytest.approx(100 * last.prefix_cache_hits / last.prefix_cache_queries, abs=0.05)
    assert line.line(line._last_time + 10.0) is not None and line.line(line._last_time + 20.0) is None


def test_kvscope_attach_sees_the_same_pool_size_and_hit_rate(loaded):
    engine, server, recorder, replies = loaded
    http = make_client()
    frames = []
    try:
        info, sample = probe_server(http, server.url)
        assert (info.num_gpu_blocks, info.block_size, info.model) == (24, 16, "tiny")
        assert info.max_model_len == 256 and info.prefix_caching
        (source_endpoint,) = info.event_sources    # discovered from /kv_event_sources, as for vLLM
        assert not source_endpoint.bind
        source = AttachSource(info, client=http, publish=frames.append, interval_s=0.2)
        thread = threading.Thread(target=source.run, args=(sample,), daemon=True)
        thread.start()
        try:
            cached = engine.snapshot().block_hashes
            wait_until(lambda: frames and frames[-1].rates is not None and frames[-1].pools and
                       frames[-1].pools[0].num_known_blocks == int((cached != 0).sum()) > 0)
        finally:
            source.stop()
            thread.join(10)
    finally:
        http.close()
    frame = frames[-1]
    last = recorder.results[-1].stats
    assert frame.pools[0].num_blocks == engine.num_blocks == 24
    assert frame.rates.hit_rate == pytest.approx(last.prefix_cache_hits / last.prefix_cache_queries)
    assert frame.connection.state == "connected"
    assert frame.streams[0].num_malformed == 0 and frame.streams[0].num_lost == 0


def test_a_request_that_waits_for_the_step_in_progress_counts_the_wait_as_queue_time():
    """The server stamps a request's arrival when it gets it, as vLLM's front end does, not when the engine's
    thread takes it between steps: a request sent while a step is held for 0.3 s shows that wait in its queue
    time (arrival to first scheduled), and the histograms vLLM exports split its TTFT into queue and prefill."""
    engine = tiny_engine(num_blocks=24)
    recorder = StepRecorder()
    engine.add_observer(recorder)
    inside, gate = threading.Event(), threading.Event()
    gate.set()
    execute = engine.runner.execute

    def gated(batch):
        inside.set()
        gate.wait(10)
        return execute(batch)

    engine.runner.execute = gated
    with running_server(engine) as server:
        api = client(server)
        first = threading.Thread(target=lambda: api.completions.create(
            model="tiny", prompt="the first", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}))
        first.start()
        wait_until(lambda: any(o.request_id for r in recorder.results for o in r.outputs))
        gate.clear()
        inside.clear()
        assert inside.wait(10)      # a step of the first request is held
        second = threading.Thread(target=lambda: api.completions.create(
            model="tiny", prompt="the second", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}))
        second.start()
        threading.Event().wait(0.3)
        gate.set()
        second.join(30)
        first.join(30)
        page = httpx.get(f"{server.url}/metrics").text
    finals = [o for r in recorder.results for o in r.outputs if o.finished]
    late = max(finals, key=lambda o: o.metrics.arrival_time).metrics
    assert late.first_scheduled_time - late.arrival_time >= 0.25
    assert late.first_token_time >= late.first_scheduled_time
    metrics = parse_metrics(page, 0.0).totals()
    ttft, queue = metrics.histogram("ttft"), metrics.histogram("queue")
    prefill = {part: float(re.search(rf"^vllm:request_prefill_time_seconds_{part}{{[^}}]*}} (\S+)$", page, re.M)[1])
               for part in ("sum", "count")}
    assert ttft.count == queue.count == prefill["count"] == 2
    assert queue.sum >= 0.25 and prefill["sum"] > 0
    assert queue.sum + prefill["sum"] == pytest.approx(ttft.sum, abs=1e-3)
