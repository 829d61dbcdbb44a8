"""kvscope serve's KV-cache events, read with the decoder, subscriber and replay client `kvscope attach` uses, against
the engine's own block pool; and the wire format against what a real vLLM 0.32 server sent (tests/data/vllm)."""

from __future__ import annotations

import httpx
import msgspec
import numpy as np
import zmq
from serve_helpers import SlowSteps, client, ipc_events, running_server, tiny_engine, wait_until
from test_serve_observability import busy_load
from vllm_fakes import SHARED, recorded_payloads

from kvscope.app.attach.feed.events import STORED, BatchDecoder
from kvscope.app.attach.feed.pool import PoolModel, hash_key
from kvscope.app.attach.feed.replay import request_replay
from kvscope.app.attach.feed.server import make_client, probe_server
from kvscope.app.attach.feed.subscriber import Delivery, EventStream
from kvscope.app.serve.kv_events import EventBatch, wire_events
from kvscope.engine.outputs import AllBlocksCleared, BlockRemoved, BlockStored


def cached_hashes(engine) -> set[int]:
    snapshot = engine.snapshot()
    return {int(h) for h in snapshot.block_hashes[snapshot.block_hashes != 0]}


def replayed(stream: EventStream) -> list:
    """What the publisher still buffers, as attach asks for it on connecting."""
    stream.bootstrap()
    return stream.wait_for_replay()


def apply(pool: PoolModel, deliveries) -> None:
    for item in deliveries:
        if isinstance(item, Delivery):
            pool.apply(item.batch.events)


def test_events_replayed_into_attachs_pool_model_give_the_engines_prefix_cache():
    engine = tiny_engine(num_blocks=24)
    with running_server(engine, kv_events=ipc_events("pool")) as server:
        http = make_client()
        context = zmq.Context()
        streams = []
        try:
            info, _ = probe_server(http, server.url)
            (endpoint,) = info.event_sources
            live = EventStream(context, endpoint)
            streams.append(live)
            pool = PoolModel(info.num_gpu_blocks, info.block_size)
            apply(pool, replayed(live))
            for _ in range(2):      # evictions: the small pool cannot keep both rounds' prefixes
                busy_load(server)
                wait_until(lambda: not engine.has_unfinished_requests())
            expected = cached_hashes(engine)
            wait_until(lambda: (apply(pool, live.drain()), set(pool.slot_of) == expected)[1], timeout_s=10)
            status = live.status()
            assert status.num_malformed == 0 and status.unknown_kinds == () and status.num_lost == 0
            assert pool.counters.num_removed > 0 and pool.counters.num_unknown_removed == 0
            # A subscriber that comes later gets the same pool from the replay socket alone.
            late = EventStream(context, endpoint)
            streams.append(late)
            fresh = PoolModel(info.num_gpu_blocks, info.block_size)
            apply(fresh, replayed(late))
            assert set(fresh.slot_of) == expected and expected
        finally:
            for stream in streams:
                stream.close()
            context.term()
            http.close()


def test_the_replay_socket_answers_as_vllms_does():
    engine = tiny_engine()
    config = ipc_events("replay")
    with running_server(engine, kv_events=config) as server:
        client(server).completions.create(model="tiny", prompt=" ".join(["block"] * 40), max_tokens=2)
        wait_until(lambda: server.publisher.seq > 0)
        context = zmq.Context()
        try:
            result = request_replay(context, config.replay_endpoint, 0)
            later = request_replay(context, config.replay_endpoint, server.publisher.seq)
        finally:
            context.term()
    assert result.complete and result.num_malformed == 0
    assert [seq for seq, _ in result.batches] == list(range(server.publisher.seq))
    assert later.complete and later.batches == ()
    decoded = BatchDecoder().decode(result.batches[0][1])
    assert decoded.data_parallel_rank == 0 and isinstance(decoded.events[0], STORED)


def _first_map(payloads, kind: str) -> dict:
    for payload in payloads:
        for event in msgspec.msgpack.decode(payload)[1]:
            if event["type"] == kind:
                return event
    raise AssertionError(f"no {kind} in the recording")


def test_the_payloads_have_vllms_fields_in_vllms_order():
    ours = msgspec.msgpack.encode(EventBatch(1.0, wire_events([
        BlockStored(11, None, tuple(range(16)), 16, 3), BlockStored(12, 11, tuple(range(16, 32)), 16, 4),
        BlockRemoved(11, 3), AllBlocksCleared()])))
    ts, events, rank = msgspec.msgpack.decode(ours)
    vllm = recorded_payloads()
    cleared = recorded_payloads(SHARED / "run2" / "kv-events.frames.jsonl")
    assert list(events[0]) == list(_first_map(vllm, "BlockStored"))
    assert list(events[1]) == list(_first_map(vllm, "BlockRemoved"))
    assert events[2] == _first_map(cleared, "AllBlocksCleared")
    assert events[0]["block_hashes"] == [11, 12] and events[0]["parent_block_hash"] is None
    assert events[0]["token_ids"] == list(range(32)) and events[0]["medium"] == "GPU"
    assert rank == 0 and ts == 1.0
    # and attach's decoder reads them as it reads vLLM's
    decoded = BatchDecoder().decode(ours)
    assert decoded.unknown == {} and [type(e).__name__ for e in decoded.events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert np.array_equal([hash_key(h) for h in decoded.events[0].block_hashes], [11, 12])


def test_a_prefix_cache_reset_reaches_subscribers_as_all_blocks_cleared():
    engine = tiny_engine()
    engine.add_observer(SlowSteps())
    with running_server(engine, kv_events=ipc_events("reset"), dev_routes=True) as server:
        http = make_client()
        context = zmq.Context()
        streams = []
        try:
            info, _ = probe_server(http, server.url)
            stream = EventStream(context, info.event_sources[0])
            streams.append(stream)
            pool = PoolModel(info.num_gpu_blocks, info.block_size)
            apply(pool, replayed(stream))
            client(server).completions.create(model="tiny", prompt=" ".join(["block"] * 40), max_tokens=2)
            wait_until(lambda: (apply(pool, stream.drain()), len(pool.slot_of) > 0)[1])
            with httpx.Client(base_url=server.url, timeout=60) as web, web.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "busy", "max_tokens": 100, "stream": True, "ignore_eos": True}) as busy:
                lines = busy.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                refused = web.post("/reset_prefix_cache")
                assert refused.status_code == 409 and "hold blocks" in refused.json()["error"]["message"]
            wait_until(lambda: not engine.has_unfinished_requests())
            assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
            wait_until(lambda: (apply(pool, stream.drain()), pool.counters.num_cleared == 1)[1])
            assert pool.slot_of == {} and cached_hashes(engine) == set()
        finally:
            for each in streams:
                each.close()
            context.term()
            http.close()


def test_the_reset_route_exists_only_when_asked_for():
    with running_server() as server:
        assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 404
