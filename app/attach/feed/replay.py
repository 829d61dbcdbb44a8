"""Asking a vLLM publisher to send again the event batches it still buffers.

vLLM's replay socket is a ROUTER. A DEALER sends an empty delimiter and the
8-byte start sequence; the replies are ``[b"", topic, seq, payload]``, one per
buffered batch from that sequence on, then ``[b"", b"", -1 as 8 bytes, b""]``.
(A REQ socket would take only the first reply.) A fresh DEALER per request,
closed without lingering, means a request to a server that went away is
dropped with its socket instead of arriving when the server comes back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

END_SEQ = -1
REPLAY_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ReplayResult:
    batches: tuple[tuple[int, bytes], ...]   # (seq, payload), in the order sent
    complete: bool                            # the end marker came before the timeout
    num_malformed: int = 0                    # replies that were not [b"", topic, seq, payload]


def decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def request_replay(context: zmq.Context, endpoint: str, start_seq: int,
                   timeout_s: float = REPLAY_TIMEOUT_S) -> ReplayResult:
    """Every batch the publisher at ``endpoint`` still holds from ``start_seq`` on."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    batches: list[tuple[int, bytes]] = []
    malformed = 0
    try:
        socket.connect(endpoint)
        socket.send_multipart([b"", start_seq.to_bytes(8, "big")], flags=zmq.NOBLOCK)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not socket.poll(int(remaining * 1000)):
                return ReplayResult(tuple(batches), False, malformed)
            frames = socket.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 3 or len(frames[1]) != 8:
                malformed += 1
                continue
            seq = decode_seq(frames[1])
            if seq == END_SEQ:
                return ReplayResult(tuple(batches), True, malformed)
            batches.append((seq, frames[2]))
    except zmq.ZMQError:
        return ReplayResult(tuple(batches), False, malformed)
    finally:
        socket.close(linger=0)
