"""One KV-event publisher: a ZMQ SUB socket, its sequence numbers, and replay when they jump.

Every message is ``[topic, 8-byte big-endian seq, msgpack payload]`` and seq
counts up from 0 per publisher. Whatever arrives, the stream hands its owner a
list of what to apply, in order:

- ``Delivery(seq, batch)`` for each batch, live or replayed;
- ``Reset(reason)`` when the sequence went backwards: the server restarted, so
  what the pool model holds is stale and must be cleared.

A jump forward is a gap (ZMQ dropped messages, or the link was down): the
missing batches are asked for again from the last sequence seen, and those the
server no longer buffers are counted as lost. On attach, and after a restart,
the whole buffer is replayed from 0, so a server that was busy before kvscope
came shows its pool at once. Live messages that a replay already delivered are
skipped. A message that is not three frames, or a payload that does not
decode, is counted and dropped; nothing a publisher sends raises out of here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import zmq

from kvscope.app.attach.feed.events import BatchDecoder, DecodedBatch, MalformedPayload
from kvscope.app.attach.feed.replay import decode_seq, request_replay
from kvscope.app.attach.feed.server import EventEndpoint

RECEIVE_HWM = 100_000   # as vLLM's publisher: a burst waits in the socket instead of being dropped
DRAIN_LIMIT = 2_000     # messages taken per call, so metrics and frames are not starved by a flood
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: pyzmq turns the enum member into one on every call otherwise


class Delivery(NamedTuple):
    seq: int
    batch: DecodedBatch


class Reset(NamedTuple):
    reason: str


@dataclass(frozen=True)
class StreamStatus:
    """What one publisher has sent since kvscope attached, for the window and the run log."""

    endpoint: str
    replay: str | None
    last_seq: int | None
    first_seq: int | None          # the first batch this run of the server delivered (0: its whole history)
    num_batches: int
    num_events: int
    num_malformed: int
    unknown_kinds: tuple[tuple[str, int], ...]
    num_gaps: int                  # jumps in the sequence seen
    num_replayed: int              # batches that came by replay
    num_lost: int                  # batches neither the live stream nor a replay delivered
    num_restarts: int
    last_event_time: float | None
    error: str | None = None


class EventStream:
    def __init__(self, context: zmq.Context, endpoint: EventEndpoint, replay_timeout_s: float = 3.0) -> None:
        self.endpoint = endpoint
        self.context = context
        self.replay_timeout_s = replay_timeout_s
        self.decoder = BatchDecoder()
        self.last_seq: int | None = None
        self.first_seq: int | None = None
        self.error: str | None = None
        # seq -> hash of the payload, for batches a replay delivered that may still arrive live.
        self._replayed: dict[int, int] = {}
        self._counts = dict(batches=0, events=0, malformed=0, gaps=0, replayed=0, lost=0, restarts=0)
        self._unknown: dict[str, int] = {}
        self._last_event_time: float | None = None
        self.socket = self._open()

    def _open(self) -> zmq.Socket:
        socket = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        socket.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic.encode())
        try:
            if self.endpoint.bind:
                socket.bind(self.endpoint.endpoint)
            else:
                socket.connect(self.endpoint.endpoint)
        except zmq.ZMQError as exc:
            self.error = f"cannot {'bind' if self.endpoint.bind else 'connect to'} {self.endpoint.endpoint}: {exc}"
        return socket

    def close(self) -> None:
        self.socket.close(linger=0)

    # --- what the owner calls -------------------------------------------------------------

    def bootstrap(self) -> list:
        """Replay the publisher's whole buffer (on attach, and after a restart)."""
        out: list = []
        if self.endpoint.replay and self.last_seq is None:
            self._replay_from(0, out)
        return out

    def reset(self, reason: str) -> list:
        """The server restarted (seen from its metrics): forget the sequence, then bootstrap."""
        self._restart()
        return [Reset(reason), *self.bootstrap()]

    def drain(self, limit: int = DRAIN_LIMIT) -> list:
        out: list = []
        for _ in range(limit):
            try:
                frames = self.socket.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                self.error = str(exc)
                break
            if len(frames) != 3 or len(frames[1]) != 8:
                self._counts["malformed"] += 1
                continue
            self._on_message(decode_seq(frames[1]), frames[2], out)
        return out

    @property
    def num_lost(self) -> int:
        return self._counts["lost"]

    def status(self) -> StreamStatus:
        c = self._counts
        return StreamStatus(
            endpoint=self.endpoint.label, replay=self.endpoint.replay, last_seq=self.last_seq,
            first_seq=self.first_seq, num_batches=c["batches"], num_events=c["events"],
            num_malformed=c["malformed"], unknown_kinds=tuple(sorted(self._unknown.items())),
            num_gaps=c["gaps"], num_replayed=c["replayed"], num_lost=c["lost"], num_restarts=c["restarts"],
            last_event_time=self._last_event_time, error=self.error)

    # --- sequence numbers --------------------------------------------------------------------

    def _on_message(self, seq: int, payload: bytes, out: list) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            if self._replayed.get(seq) == hash(payload):
                return  # a replay already delivered it
            self._restart()
            out.append(Reset(f"the event sequence went back from {last} to {seq}: the server restarted"))
        expected = self._expected()
        if expected is not None and seq > expected:
            if self.last_seq is not None:
                self._counts["gaps"] += 1
            if self.endpoint.replay:
                self._replay_from(expected, out)
                if self.last_seq is not None and seq <= self.last_seq:
                    return
                expected = self._expected()
            if self.last_seq is not None and seq > expected:
                self._counts["lost"] += seq - expected
        if seq not in self._replayed:
            self._replayed.clear()  # live again past what the replay sent: no duplicates can follow
        self._deliver(seq, payload, out)

    def _expected(self) -> int | None:
        if self.last_seq is not None:
            return self.last_seq + 1
        return 0 if self.endpoint.replay else None

    def _restart(self) -> None:
        self._counts["restarts"] += 1
        self.last_seq = self.first_seq = None
        self._replayed.clear()

    def _replay_from(self, start: int, out: list) -> None:
        result = request_replay(self.context, self.endpoint.replay, start, self.replay_timeout_s)
        self._counts["malformed"] += result.num_malformed
        self._replayed.clear()
        for seq, payload in result.batches:
            if self.last_seq is not None and seq <= self.last_seq:
                continue
            if self.last_seq is not None and seq > self.last_seq + 1:
                self._counts["lost"] += seq - self.last_seq - 1
            self._replayed[seq] = hash(payload)
            self._counts["replayed"] += 1
            self._deliver(seq, payload, out)

    def _deliver(self, seq: int, payload: bytes, out: list) -> None:
        self.last_seq = seq
        if self.first_seq is None:
            self.first_seq = seq
        try:
            batch = self.decoder.decode(payload)
        except MalformedPayload:
            self._counts["malformed"] += 1
            return
        self._counts["batches"] += 1
        self._counts["events"] += len(batch.events)
        self._last_event_time = batch.ts
        for kind, count in batch.unknown.items():
            self._unknown[kind] = self._unknown.get(kind, 0) + count
        out.append(Delivery(seq, batch))
