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

A replay is never waited for (replay.py): while one is in flight the stream
reads its replies as they come, and live messages wait in the SUB socket
(RECEIVE_HWM of them) until it ends, so they are applied in order after it. A
replay that ended badly (no answer, too slow, too big) is not asked for again
for REPLAY_COOLDOWN_S, twice that after two in a row, up to eight times: the
gaps in between are counted as lost. What is kept
per stream is bounded: unknown event kinds are named up to MAX_UNKNOWN_KINDS,
then counted together; a message past MAX_MESSAGE_BYTES never reaches here.

libzmq drops the link that carried a message past that size and, taking it
for a protocol error, never connects again: the stream watches its socket's
DISCONNECTED events and opens a fresh socket when one comes (``check_link``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import zmq

from kvscope.app.attach.feed.events import BatchDecoder, DecodedBatch, MalformedPayload
from kvscope.app.attach.feed.limits import MAX_MESSAGE_BYTES, MAX_RANKS, MAX_UNKNOWN_KINDS, REPLAY_COOLDOWN_S
from kvscope.app.attach.feed.replay import COMPLETE, ReplayRequest, decode_seq
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
    num_malformed: int                 # messages that were not batches, and batches naming no plausible rank
    unknown_kinds: tuple[tuple[str, int], ...]   # at most MAX_UNKNOWN_KINDS named, by count
    num_gaps: int                  # jumps in the sequence seen
    num_replayed: int              # batches that came by replay
    num_lost: int                  # batches neither the live stream nor a replay delivered
    num_restarts: int
    last_event_time: float | None
    error: str | None = None
    num_other_unknown: int = 0         # events of kinds past the ones named
    num_other_kinds: int = 0           # how many kinds those were, at least
    replaying: bool = False            # a replay is in flight
    replay_problem: str | None = None  # how the latest replay that did not complete ended
    num_reopened: int = 0              # links dropped (an oversized message, the server gone) and opened again


class EventStream:
    def __init__(self, context: zmq.Context, endpoint: EventEndpoint, **replay_limits: float) -> None:
        self.endpoint = endpoint
        self.context = context
        self.replay_limits = replay_limits    # ReplayRequest's idle_s and deadline_s, when not the defaults
        self.replay: ReplayRequest | None = None
        self.replay_problem: str | None = None
        self._held: tuple[int, bytes] | None = None   # the live message that showed the gap being replayed
        self._no_replay_until = 0.0
        self._bad_replays = 0     # in a row
        self.decoder = BatchDecoder()
        self.last_seq: int | None = None
        self.first_seq: int | None = None
        self.error: str | None = None
        # seq -> hash of the payload, for batches a replay delivered that may still arrive live.
        self._replayed: dict[int, int] = {}
        self._counts = dict(batches=0, events=0, malformed=0, gaps=0, replayed=0, lost=0, restarts=0, reopened=0)
        self._monitor: zmq.Socket | None = None
        self._unknown: dict[str, int] = {}
        self._other_unknown = [0, set()]    # events past MAX_UNKNOWN_KINDS kinds, and a sample of their kinds
        self._last_event_time: float | None = None
        self.socket = self._open()

    def _open(self) -> zmq.Socket:
        socket = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic.encode())
        try:
            if self.endpoint.bind:
                socket.bind(self.endpoint.endpoint)
            else:
                socket.connect(self.endpoint.endpoint)
        except zmq.ZMQError as exc:
            self.error = f"cannot {'bind' if self.endpoint.bind else 'connect to'} {self.endpoint.endpoint}: {exc}"
            return socket
        if not self.endpoint.bind:   # a publisher that connects to us reconnects by itself
            self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return socket

    def _close_socket(self) -> None:
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self.socket.close(linger=0)

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        self._close_socket()

    def check_link(self) -> None:
        """A fresh socket if the link was dropped: for good after an oversized message, or until libzmq's
        own retry after a server that went away (a fresh socket then costs nothing but the retry)."""
        dropped = False
        while self._monitor is not None:
            try:
                self._monitor.recv_multipart(_NOBLOCK)
                dropped = True
            except zmq.Again:
                break
        if dropped:
            self._counts["reopened"] += 1
            self._close_socket()
            self.socket = self._open()

    # --- what the owner calls -------------------------------------------------------------

    @property
    def waiting_on(self) -> zmq.Socket:
        """The socket whose messages come next: the replay's while one is in flight, else the live one."""
        return self.replay.socket if self.replay is not None else self.socket

    def bootstrap(self) -> None:
        """Ask for the publisher's whole buffer (on attach, and after a restart); drain() delivers it."""
        if self.endpoint.replay and self.last_seq is None and self.replay is None:
            self._start_replay(0)

    def reset(self, reason: str) -> list:
        """The server restarted (seen from its metrics): forget the sequence, then bootstrap."""
        self._restart()
        self.bootstrap()
        return [Reset(reason)]

    def drain(self, limit: int = DRAIN_LIMIT) -> list:
        """What arrived, at most ``limit`` messages, without waiting: the replay in flight's replies (and
        its end), else live messages."""
        out: list = []
        if self.replay is not None:
            self._take_replay(limit, out)
            if self.replay is not None:
                return out
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
            if self.replay is not None:
                break   # a gap: the rest waits in the socket until the replay has filled it
        return out

    def wait_for_replay(self, timeout_s: float = 30.0) -> list:
        """drain() until no replay is in flight (for tests and tools: the window never waits)."""
        out: list = []
        deadline = time.monotonic() + timeout_s
        while self.replay is not None and time.monotonic() < deadline:
            self.replay.socket.poll(50)
            out.extend(self.drain())
        return out

    @property
    def num_lost(self) -> int:
        return self._counts["lost"]

    def status(self) -> StreamStatus:
        c = self._counts
        unknown = sorted(self._unknown.items(), key=lambda item: (-item[1], item[0]))
        return StreamStatus(
            endpoint=self.endpoint.label, replay=self.endpoint.replay, last_seq=self.last_seq,
            first_seq=self.first_seq, num_batches=c["batches"], num_events=c["events"],
            num_malformed=c["malformed"], unknown_kinds=tuple(unknown),
            num_gaps=c["gaps"], num_replayed=c["replayed"], num_lost=c["lost"], num_restarts=c["restarts"],
            last_event_time=self._last_event_time, error=self.error, num_other_unknown=self._other_unknown[0],
            num_other_kinds=len(self._other_unknown[1]), replaying=self.replay is not None,
            num_reopened=c["reopened"],
            replay_problem=self.replay_problem)

    # --- sequence numbers --------------------------------------------------------------------

    def _on_message(self, seq: int, payload: bytes, out: list, may_replay: bool = True) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            if self._replayed.get(seq) == hash(payload):
                return  # a replay already delivered it
            self._restart()
            out.append(Reset(f"the event sequence went back from {last} to {seq}: the server restarted"))
        expected = self._expected()
        if expected is not None and seq > expected:
            if may_replay and self.endpoint.replay and time.monotonic() >= self._no_replay_until:
                if self.last_seq is not None:
                    self._counts["gaps"] += 1
                self._held = (seq, payload)
                self._start_replay(expected)
                return
            if self.last_seq is not None:
                if may_replay:
                    self._counts["gaps"] += 1
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
        if self.replay is not None:
            self.replay.close()
            self.replay = None
        self._held = None

    def _start_replay(self, start: int) -> None:
        self._replayed.clear()
        self.replay = ReplayRequest(self.context, self.endpoint.replay, start, **self.replay_limits)

    def _take_replay(self, limit: int, out: list) -> None:
        replay = self.replay
        for seq, payload in replay.take(limit):
            if self.last_seq is not None and seq <= self.last_seq:
                continue
            if self.last_seq is not None and seq > self.last_seq + 1:
                self._counts["lost"] += seq - self.last_seq - 1
            self._replayed[seq] = hash(payload)
            self._counts["replayed"] += 1
            self._deliver(seq, payload, out)
        if replay.outcome is None:
            return
        self.replay = None
        self._counts["malformed"] += replay.num_malformed
        if replay.outcome == COMPLETE:
            self._bad_replays = 0
        else:
            self.replay_problem = f"replay from seq {replay.start_seq:,}: {replay.outcome}"
            self._no_replay_until = time.monotonic() + REPLAY_COOLDOWN_S * 2 ** min(self._bad_replays, 3)
            self._bad_replays += 1
        held, self._held = self._held, None
        if held is not None:    # the live message that showed the gap; what the replay did not fill is lost
            self._on_message(*held, out, may_replay=False)

    def _deliver(self, seq: int, payload: bytes, out: list) -> None:
        self.last_seq = seq
        if self.first_seq is None:
            self.first_seq = seq
        try:
            batch = self.decoder.decode(payload)
        except MalformedPayload:
            self._counts["malformed"] += 1
            return
        rank = batch.data_parallel_rank
        if rank is not None and not 0 <= rank < MAX_RANKS:
            self._counts["malformed"] += 1
            return
        self._counts["batches"] += 1
        self._counts["events"] += len(batch.events)
        self._last_event_time = batch.ts
        for kind, count in batch.unknown.items():
            self._count_unknown(kind, count)
        out.append(Delivery(seq, batch))

    def _count_unknown(self, kind: str, count: int) -> None:
        if kind in self._unknown or len(self._unknown) < MAX_UNKNOWN_KINDS:
            self._unknown[kind] = self._unknown.get(kind, 0) + count
            return
        others = self._other_unknown
        others[0] += count
        if len(others[1]) < MAX_UNKNOWN_KINDS * 64:    # enough to say "at least N kinds", and bounded
            others[1].add(kind)
