"""Asking a vLLM publisher to send again the event batches it still buffers, without ever waiting on it.

vLLM's replay socket is a ROUTER. A DEALER sends an empty delimiter and the
8-byte start sequence; the replies are ``[b"", topic, seq, payload]``, one per
buffered batch from that sequence on, then ``[b"", b"", -1 as 8 bytes, b""]``.
(A REQ socket would take only the first reply.) A fresh DEALER per request,
closed without lingering, means a request to a server that went away is
dropped with its socket instead of arriving when the server comes back.

A ReplayRequest is taken from as its replies arrive (``take``): the data source
polls its socket with the others and never blocks on it, so a replay that never
answers, or answers forever, holds up neither sampling nor stopping. A request
ends at the end marker, or cut short: after REPLAY_IDLE_S without a reply,
REPLAY_DEADLINE_S in all, or REPLAY_MAX_BATCHES / REPLAY_MAX_BYTES of replies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from kvscope.app.attach.feed.limits import (
    MAX_MESSAGE_BYTES,
    REPLAY_DEADLINE_S,
    REPLAY_IDLE_S,
    REPLAY_MAX_BATCHES,
    REPLAY_MAX_BYTES,
)

END_SEQ = -1
COMPLETE = "complete"
_NOBLOCK = int(zmq.NOBLOCK)


@dataclass(frozen=True)
class ReplayResult:
    batches: tuple[tuple[int, bytes], ...]   # (seq, payload), in the order sent
    complete: bool                            # the end marker came before any limit
    num_malformed: int = 0                    # replies that were not [b"", topic, seq, payload]


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class ReplayRequest:
    """One replay in flight. ``outcome`` is None until it ends: COMPLETE, or why it was cut short."""

    def __init__(self, context: zmq.Context, endpoint: str, start_seq: int, *, idle_s: float | None = None,
                 deadline_s: float | None = None) -> None:
        self.start_seq = start_seq
        self.idle_s = REPLAY_IDLE_S if idle_s is None else idle_s
        self.deadline_s = REPLAY_DEADLINE_S if deadline_s is None else deadline_s
        self.num_batches = self.num_bytes = self.num_malformed = 0
        self.outcome: str | None = None
        self.started = self.last_reply = time.monotonic()
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            self.socket.connect(endpoint)
            self.socket.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)], flags=_NOBLOCK)
        except zmq.ZMQError as exc:
            self._end(f"the request failed ({exc})")

    def take(self, limit: int) -> list[tuple[int, bytes]]:
        """The replies that have arrived, at most ``limit``, in order; ends the request when it is over."""
        out: list[tuple[int, bytes]] = []
        while self.outcome is None and len(out) < limit:
            try:
                frames = self.socket.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                self._end(f"the replay socket failed ({exc})")
                break
            self.last_reply = time.monotonic()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 3 or len(frames[1]) != 8:
                self.num_malformed += 1
                continue
            seq = decode_seq(frames[1])
            if seq == END_SEQ:
                self._end(COMPLETE)
                break
            self.num_batches += 1
            self.num_bytes += len(frames[2])
            out.append((seq, frames[2]))
            if self.num_batches >= REPLAY_MAX_BATCHES or self.num_bytes >= REPLAY_MAX_BYTES:
                self._end(f"cut after {self.num_batches:,} batches, {self.num_bytes / 2**20:,.0f} MiB "
                          f"(at most {REPLAY_MAX_BATCHES:,} and {REPLAY_MAX_BYTES >> 20} MiB)")
        self._check_time()
        return out

    def _check_time(self) -> None:
        if self.outcome is not None:
            return
        now = time.monotonic()
        if now - self.last_reply >= self.idle_s:
            self._end("no answer" if self.num_batches == 0 and not self.num_malformed else
                      f"it stopped answering after {self.num_batches:,} batches")
        elif now - self.started >= self.deadline_s:
            self._end(f"cut at {self.deadline_s:g} s, after {self.num_batches:,} batches")

    def _end(self, outcome: str) -> None:
        self.outcome = outcome
        self.socket.close(linger=0)

    def close(self) -> None:
        if self.outcome is None:
            self._end("stopped")


def request_replay(context: zmq.Context, endpoint: str, start_seq: int,
                   timeout_s: float | None = None) -> ReplayResult:
    """Every batch the publisher at ``endpoint`` still holds from ``start_seq`` on, waiting for them: for
    tools and tests (the window never waits, see ReplayRequest). ``timeout_s`` is the longest silence."""
    request = ReplayRequest(context, endpoint, start_seq, idle_s=timeout_s)
    batches: list[tuple[int, bytes]] = []
    while request.outcome is None:
        if request.socket.poll(50):
            batches.extend(request.take(1000))
        else:
            request.take(0)
    return ReplayResult(tuple(batches), request.outcome == COMPLETE, request.num_malformed)
