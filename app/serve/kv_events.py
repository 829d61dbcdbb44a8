"""KV-cache events in vLLM's wire format, published over ZMQ from kvscope's engine, with vLLM's replay socket.

``--kv-events-config`` takes vLLM's JSON (enable_kv_cache_events, publisher, endpoint, replay_endpoint,
buffer_steps, hwm, max_queue_size, topic). Each engine step that changed the prefix cache becomes one message
``[topic, 8-byte big-endian seq, msgpack payload]``, seq counting from 0; the payload is vLLM's
``[ts, [events], data_parallel_rank]`` with map-encoded BlockStored / BlockRemoved / AllBlocksCleared events,
every field vLLM 0.32 sends, in its order. Consecutive blocks of one chain are one BlockStored, as vLLM sends
a request's new blocks. The endpoint is bound or connected by vLLM's rule (bind a wildcard, ``ipc://`` or
``inproc://`` address; connect to a concrete one), and the replay ROUTER answers ``[b"", start seq]`` with
every buffered batch from there, then the end marker, so any vLLM KV-event consumer works unchanged.

With no flag, kvscope serve publishes on ``ipc://`` sockets in the temporary directory: reachable only from
this machine, like the API's loopback default, and found by ``kvscope attach`` through /kv_event_sources.

The engine thread only converts and queues (``step`` is an engine observer); one publisher thread owns both
sockets, since ZMQ sockets are not thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import tempfile
import threading
import time
import uuid
from collections import deque

import msgspec
import zmq

from kvscope.app.serve.connections import is_loopback
from kvscope.engine import outputs as engine_outputs

log = logging.getLogger("kvscope.serve")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 20
MEDIUM = "GPU"      # what vLLM tags its device pool with, on CPU builds too


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's KVEventsConfig: its field names, defaults and JSON."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class KVEventsConfigError(ValueError):
    pass


def parse_config(text: str) -> KVEventsConfig:
    try:
        config = msgspec.json.decode(text.encode(), type=KVEventsConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise KVEventsConfigError(f"--kv-events-config: {exc}") from None
    if config.publisher not in ("zmq", "null"):
        raise KVEventsConfigError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {config.publisher!r}")
    if config.buffer_steps < 1 or config.hwm < 0 or config.max_queue_size < 1:
        raise KVEventsConfigError("--kv-events-config: buffer_steps and max_queue_size must be at least 1, "
                                  "hwm at least 0")
    return config


def default_config() -> KVEventsConfig:
    """Sockets only this machine reaches (ipc), named after this process."""
    stem = os.path.join(tempfile.gettempdir(), f"kvscope-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{stem}-kv-events",
                          replay_endpoint=f"ipc://{stem}-kv-replay", topic="kv-events")


def sources(config: KVEventsConfig | None) -> dict:
    """GET /kv_event_sources, as vLLM answers it: the config per data-parallel rank."""
    if config is None or not config.enable_kv_cache_events:
        return {}
    return {"0": json.loads(msgspec.json.encode(config))}


def exposure_warning(config: KVEventsConfig) -> str | None:
    """What a TCP event endpoint on a wildcard or non-loopback address means, in words; None when every
    endpoint stays on this machine (ipc://, inproc://, tcp://127.0.0.1)."""
    exposed = [endpoint for endpoint in (config.endpoint, config.replay_endpoint) if endpoint
               and endpoint.startswith("tcp://") and not is_loopback(endpoint[6:].rpartition(":")[0])]
    if not config.enable_kv_cache_events or not exposed:
        return None
    return (f"KV-cache events are published on {', '.join(exposed)}, which the network can reach: they carry every "
            "request's token ids, and no API key guards them; use tcp://127.0.0.1:PORT or ipc:// to keep them on "
            "this machine")


def binds(endpoint: str) -> bool:
    """vLLM's rule for who binds the event socket."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# ---- the wire ---------------------------------------------------------------------------------------------

class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = MEDIUM
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = 0


def wire_events(engine_events) -> list:
    """The engine's per-block events as vLLM sends them: a chain of stored blocks becomes one BlockStored."""
    out: list = []
    for event in engine_events:
        if isinstance(event, engine_outputs.BlockStored):
            last = out[-1] if out else None
            if isinstance(last, BlockStored) and last.block_hashes[-1] == event.parent_block_hash and \
                    last.block_size == event.block_size:
                last.block_hashes.append(event.block_hash)
                last.token_ids.extend(event.token_ids)
                last.extra_keys.append(None)
            else:
                out.append(BlockStored([event.block_hash], event.parent_block_hash, list(event.token_ids),
                                       event.block_size, extra_keys=[None]))
        elif isinstance(event, engine_outputs.BlockRemoved):
            out.append(BlockRemoved([event.block_hash]))
        elif isinstance(event, engine_outputs.AllBlocksCleared):
            out.append(AllBlocksCleared())
    return out


class KVEventPublisher:
    """Publishes each step's prefix-cache events; an engine observer. ``close()`` sends what is queued first."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.topic = config.topic.encode()
        self.num_dropped_batches = 0
        self.seq = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context()
        self._stop = threading.Event()
        try:
            self._pub = self._socket(zmq.PUB, config.endpoint, binds(config.endpoint))
            self._router = self._socket(zmq.ROUTER, config.replay_endpoint, True) if config.replay_endpoint \
                else None
        except zmq.ZMQError:
            self._context.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="kvscope-serve-kv-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUB:
            socket.setsockopt(zmq.SNDHWM, self.config.hwm)
        try:
            socket.bind(endpoint) if bind else socket.connect(endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise zmq.ZMQError(exc.errno, f"cannot {'bind' if bind else 'connect to'} {endpoint}: {exc}") from None
        return socket

    # --- the engine's observer interface ------------------------------------------------------------------

    def request_added(self, request_id: str, prompt_text: str, num_prompt_tokens: int, n: int) -> None:
        pass

    def step(self, result) -> None:
        events = result.kv_events
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), wire_events(events)))
        except queue.Full:
            self.num_dropped_batches += 1

    def publish_cleared(self) -> None:
        """Tell subscribers the pool is empty (its engine was replaced by one with a fresh pool)."""
        try:
            self._queue.put_nowait((time.time(), [AllBlocksCleared()]))
        except queue.Full:
            self.num_dropped_batches += 1

    # --- the publisher thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if self._router is not None:
                if poller.poll(POLL_MS):
                    self._serve_replay()
            else:
                self._stop.wait(POLL_MS / 1000)
            self._send_queued()
        self._send_queued()

    def _send_queued(self) -> None:
        while True:
            try:
                ts, events = self._queue.get_nowait()
            except queue.Empty:
                return
            payload = self._encoder.encode(EventBatch(ts, events))
            seq = self.seq
            self.seq += 1
            self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass    # no peer yet on a connected socket, or its queue is full: replay has it

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                continue    # not a replay request
            client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for socket in (self._pub, self._router):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
        for endpoint in (self.config.endpoint, self.config.replay_endpoint):
            if endpoint and endpoint.startswith("ipc://") and binds(endpoint):
                try:
                    os.unlink(endpoint.removeprefix("ipc://"))
                except OSError:
                    pass
