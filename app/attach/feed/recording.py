"""Recorded ZMQ messages: one JSON line per message, ``{"frames": [base64, ...]}``.

The format of the samples recorded from real vLLM servers (tests/data/vllm/),
read back by the tests and by ``kvscope bench attach``, and written by the
recorder script (tests/vllm/record_samples.py).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from pathlib import Path


def read_messages(path: str | Path) -> Iterator[list[bytes]]:
    with open(path) as lines:
        for line in lines:
            if line.strip():
                yield [base64.b64decode(frame) for frame in json.loads(line)["frames"]]


def write_messages(path: str | Path, messages: Iterable[list[bytes]]) -> int:
    count = 0
    with open(path, "w") as out:
        for frames in messages:
            out.write(json.dumps({"frames": [base64.b64encode(f).decode() for f in frames]}) + "\n")
            count += 1
    return count


def live_messages(path: str | Path) -> list[tuple[bytes, int, bytes]]:
    """(topic, seq, payload) of each recorded live (PUB) message."""
    return [(topic, int.from_bytes(seq, "big", signed=True), payload)
            for topic, seq, payload in read_messages(path)]
