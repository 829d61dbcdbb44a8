"""The attach data source against stand-in servers fed with recorded vLLM data: probing, frames,
losing and finding the server again, restarts, several ranks, and the run log it writes."""

from __future__ import annotations

import contextlib
import threading

import msgspec
import pytest
from vllm_fakes import SHARED, FakePublisher, FakeServer, recorded_payloads, until

from kvscope.app.attach.feed import source as source_module
from kvscope.app.attach.feed.frame import CONNECTED, DISCONNECTED
from kvscope.app.attach.feed.metrics import parse_metrics
from kvscope.app.attach.feed.run_log import AttachRunLog
from kvscope.app.attach.feed.server import AttachError, EventEndpoint, make_client, probe_server
from kvscope.app.attach.feed.source import AttachSource
from kvscope.app.runlog import RunLogReader

PAGE = (SHARED / "metrics.txt").read_text()
IDLE = (SHARED / "metrics-idle.txt").read_text()
PAYLOADS = recorded_payloads()


def zmq_sources(publisher: FakePublisher, rank: int = 0) -> dict:
    """What /kv_event_sources says for a publisher bound on a wildcard, as vLLM binds it."""
    def wildcard(endpoint: str) -> str:
        return endpoint.replace("//127.0.0.1:", "//*:")

    return {str(rank): {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": wildcard(publisher.endpoint),
                        "replay_endpoint": wildcard(publisher.replay_endpoint), "topic": "kv-events"}}


@pytest.fixture
def client():
    with make_client() as client:
        yield client


class Frames(list):
    def __call__(self, frame) -> None:
        self.append(frame)


@contextlib.contextmanager
def attached(client, context, server: FakeServer, **source_options):
    """Probe the stand-in server and open its event streams; they are closed however the test ends."""
    info, sample = probe_server(client, server.url)
    source = AttachSource(info, client=client, publish=Frames(), **source_options)
    source.open_streams(context)
    try:
        yield source, sample
    finally:
        for stream in source.streams:
            stream.close()


def test_probe_reads_the_pool_the_model_and_the_event_sources(client):
    server = FakeServer(PAGE, sources={"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                             "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                                             "topic": "kv-events"}})
    try:
        info, sample = probe_server(client, server.url.removeprefix("http://") + "/")
    finally:
        server.close()
    assert (info.num_gpu_blocks, info.block_size, info.version, info.model) == (96, 32, "0.32.0", "smollm2")
    assert info.engines == ("0",) and info.prefix_caching and info.max_model_len == 1024
    (source,) = info.event_sources
    assert (source.endpoint, source.replay, source.bind) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", False)
    assert sample.totals().prefix_cache_hits == 1920


def test_a_server_that_connects_to_its_subscriber_makes_kvscope_bind(client):
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557",
              "replay_endpoint": "tcp://*:5558"}
    server = FakeServer(PAGE, sources={"0": config})
    try:
        (source,) = probe_server(client, server.url)[0].event_sources
    finally:
        server.close()
    assert source.bind and source.endpoint == "tcp://127.0.0.1:5557"


def test_without_event_sources_the_window_is_told_the_flag(client):
    server = FakeServer(PAGE, sources={})
    try:
        info = probe_server(client, server.url)[0]
    finally:
        server.close()
    assert info.event_sources == () and "--kv-events-config" in info.events_note


def test_an_unreachable_server_is_one_clear_error(client):
    server = FakeServer(PAGE)
    server.stop()
    with pytest.raises(AttachError, match=f"cannot reach {server.url}: connection refused"):
        probe_server(client, server.url)


@pytest.mark.parametrize("page, status, says", [
    ("<html>hello</html>", 200, "has no vllm: series"),
    ("not found", 404, "answered HTTP 404"),
    ("# TYPE python_info gauge\npython_info 1.0\n", 200, "has no vllm: series"),
])
def test_a_url_that_is_not_vllm_is_a_clear_error(client, page, status, says):
    server = FakeServer(page)
    server.status = status
    try:
        with pytest.raises(AttachError, match=says):
            probe_server(client, server.url)
    finally:
        server.close()


RUNNING: list[tuple[AttachSource, threading.Thread]] = []


@pytest.fixture(autouse=True)
def stop_sources(client):
    """Stops the threads a test started, before the client they read with is closed."""
    yield
    while RUNNING:
        source, thread = RUNNING.pop()
        source.stop()
        thread.join(5)


def run_source(source: AttachSource, first_sample) -> threading.Thread:
    thread = threading.Thread(target=source.run, args=(first_sample,), daemon=True)
    thread.start()
    RUNNING.append((source, thread))
    return thread


def test_frames_show_the_pool_from_replay_and_live_events(client, context):
    publisher = FakePublisher(context)
    for seq, payload in enumerate(PAYLOADS[:20]):
        publisher.publish(seq, payload, live=False)
    server = FakeServer(PAGE, sources=zmq_sources(publisher))
    frames = Frames()
    try:
        info, sample = probe_server(client, server.url)
        source = AttachSource(info, client=client, publish=frames, interval_s=0.1)
        thread = run_source(source, sample)
        publisher.wait_for_subscriber()
        until(lambda: frames and frames[-1].streams and frames[-1].streams[0].last_seq == 19)
        for seq in range(20, len(PAYLOADS)):
            publisher.publish(seq, PAYLOADS[seq])
        until(lambda: frames[-1].streams[0].last_seq == len(PAYLOADS) - 1)
        source.stop()
        thread.join(5)
    finally:
        publisher.close()
        server.close()
    last = frames[-1]
    (pool,) = last.pools
    assert pool.num_known_blocks == 94 and pool.num_blocks == 96
    assert pool.counters.num_unknown_removed == 0 and last.connection.state == CONNECTED
    assert last.rates.hit_rate == 1920 / 11660 and last.sample_index >= 2
    assert all(frame.pools[0].num_known_blocks <= 96 for frame in frames)


def test_losing_the_server_says_so_then_reconnects_with_backoff(client, monkeypatch):
    monkeypatch.setattr(source_module, "BACKOFF_S", (0.05, 0.1, 0.2))
    server = FakeServer(PAGE, sources={})
    frames = Frames()
    try:
        info, sample = probe_server(client, server.url)
        source = AttachSource(info, client=client, publish=frames, interval_s=0.05)
        thread = run_source(source, sample)
        until(lambda: len(frames) >= 2)
        server.stop()
        until(lambda: sum(f.connection.state == DISCONNECTED for f in frames) >= 3)
        down = [f.connection for f in frames if f.connection.state == DISCONNECTED]
        # The first try may be cut mid-answer ("the connection was lost"); the next find nobody there.
        assert down[0].label == "disconnected, retrying" and down[0].detail
        assert "connection refused" in down[-1].detail
        assert [c.retry_in_s for c in down[:3]] == [0.05, 0.1, 0.2]
        server.start()
        until(lambda: frames[-1].connection.state == CONNECTED)
        source.stop()
        thread.join(5)
    finally:
        server.close()
    texts = [n.text for n in frames[-1].notices]
    assert any(t.startswith("lost ") for t in texts) and any(t.startswith("reconnected") for t in texts)


def test_a_restarted_server_clears_the_map_and_says_so(client, context):
    publisher = FakePublisher(context)
    for seq, payload in enumerate(PAYLOADS):
        publisher.publish(seq, payload, live=False)
    server = FakeServer(PAGE, sources=zmq_sources(publisher))
    try:
        with attached(client, context, server, interval_s=0.05) as (source, sample):
            source.take_sample(sample)
            source.bootstrap_streams(wait=True)
            assert source.make_frame().pools[0].num_known_blocks == 94
            publisher.restart()
            run2 = recorded_payloads(SHARED / "run2" / "kv-events.frames.jsonl")
            publisher.publish(0, run2[0], live=False)
            restarted = IDLE.replace("process_start_time_seconds 1.7961542469e+09",
                                     "process_start_time_seconds 1.8e+09")
            assert restarted != IDLE
            source.take_sample(parse_metrics(restarted, sample.time + 5))
            source.apply(0, source.streams[0].wait_for_replay())   # the new buffer, as the thread would take it
            frame = source.make_frame()
    finally:
        publisher.close()
        server.close()
    assert frame.pools[0].num_known_blocks == 20       # the new server's first request, from its replay
    assert any("the server restarted" in n.text for n in frame.notices)
    assert frame.streams[0].num_restarts == 1


def test_data_parallel_ranks_get_a_pool_each(client, context):
    publishers = [FakePublisher(context), FakePublisher(context)]
    for rank, publisher in enumerate(publishers):
        for seq, payload in enumerate(PAYLOADS[:12]):
            ts, events, _ = msgspec.msgpack.decode(payload)
            publisher.publish(seq, msgspec.msgpack.encode([ts, events, rank]), live=False)
    sources = {**zmq_sources(publishers[0], 0), **zmq_sources(publishers[1], 1)}
    server = FakeServer(PAGE, sources=sources)
    try:
        with attached(client, context, server) as (source, sample):
            source.bootstrap_streams(wait=True)
            source.take_sample(sample)
            frame = source.make_frame()
    finally:
        for publisher in publishers:
            publisher.close()
        server.close()
    assert [pool.label for pool in frame.pools] == ["rank 0", "rank 1"]
    assert [pool.num_known_blocks for pool in frame.pools] == [95, 95]
    assert frame.pools[0].num_in_use_blocks == 0      # engine "0" of the page; rank 1 has none here
    assert frame.pools[1].num_in_use_blocks is None


def test_unknown_and_malformed_payloads_are_counted_in_the_frame(client, context):
    publisher = FakePublisher(context)
    publisher.publish(0, PAYLOADS[0], live=False)
    publisher.publish(1, b"\x92\x01", live=False)
    publisher.publish(2, msgspec.msgpack.encode([1.0, [{"type": "BlockPinned"}], 0]), live=False)
    server = FakeServer(PAGE, sources=zmq_sources(publisher))
    try:
        with attached(client, context, server) as (source, _):
            source.bootstrap_streams(wait=True)
            frame = source.make_frame()
    finally:
        publisher.close()
        server.close()
    (stream,) = frame.streams
    assert stream.num_malformed == 1 and stream.unknown_kinds == (("BlockPinned", 1),)
    assert frame.pools[0].num_known_blocks == 20


def test_an_attached_session_is_a_vllm_run_in_the_run_log(client, context, tmp_path):
    publisher = FakePublisher(context)
    server = FakeServer(IDLE, sources=zmq_sources(publisher))
    db = tmp_path / "runs.db"
    try:
        info, sample = probe_server(client, server.url)
        run_log = AttachRunLog.open(db, info, interval_s=1.0)
        source = AttachSource(info, client=client, publish=Frames(), run_log=run_log)
        source.open_streams(context)
        source.take_sample(sample)
        for seq, payload in enumerate(PAYLOADS[:13]):
            publisher.publish(seq, payload, live=False)
        source.bootstrap_streams(wait=True)
        source.take_sample(parse_metrics(PAGE, sample.time + 1.0))
        run_log.close()
    finally:
        for stream in source.streams:
            stream.close()
        publisher.close()
        server.close()
    reader = RunLogReader(db)
    (run,) = reader.list_runs()
    assert run["source"] == "vllm" and run["model"] == "smollm2" and run["status"] == "finished"
    details = reader.run(run["id"])
    assert details["num_steps"] == 2 and details["prefix_cache_hits"] == 1920
    assert details["num_generated_tokens"] == 2018      # the page's counter, all since the idle sample
    assert details["events"]["kv_stored"] == 1 and details["events"]["kv_removed"] == 1
    frames = list(reader.iter_snapshots(run["id"]))
    assert [f.snapshot.num_blocks for f in frames] == [96, 96]
    assert int((frames[-1].snapshot.block_fill == 32).sum()) == source.make_frame().pools[0].num_known_blocks
    assert frames[-1].stats.kv_token_utilisation is None and frames[-1].stats.num_swapped == 0
    reader.close()


def test_user_given_endpoints_win_over_discovery(client, context):
    publisher = FakePublisher(context)
    server = FakeServer(PAGE, sources={})
    try:
        endpoints = (EventEndpoint(publisher.endpoint, publisher.replay_endpoint),)
        info = probe_server(client, server.url, event_endpoints=endpoints)[0]
    finally:
        publisher.close()
        server.close()
    assert info.event_sources == endpoints and info.events_note == ""
