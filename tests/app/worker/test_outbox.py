"""The engine process's frames (app/worker/outbox.py): whole and in order however the socket takes them, never
holding the sender for a reader that is behind, all sent before close returns, and a reader that went told once;
and the window's acknowledgements, sent in bulk (app/worker/process.py)."""

from __future__ import annotations

import socket
import threading

import pytest

from kvscope.app.worker import outbox, process
from kvscope.app.worker.outbox import FrameReader, FrameWriter
from kvscope.app.worker.process import ACK_EVERY_STEPS, EngineProcess
from kvscope.engine.config import EngineConfig

# Bigger than any send buffer the system gives, and small ones on either side of them.
SIZES = [0, 1, 100, 300_000, 5, 9_000_000, 7, 2_000_000, 3]


def frames() -> list[bytes]:
    return [bytes([index + 1]) * size for index, size in enumerate(SIZES)]


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setattr(outbox, "SEND_BUFFER", 4096)    # the kernel's least: most frames go in parts
    engine_end, window_end = socket.socketpair()
    yield engine_end, window_end
    engine_end.close()
    window_end.close()


def read_all(reader: FrameReader, count: int) -> list:
    return [reader.read() for _ in range(count)]


def test_frames_sent_while_nobody_reads_arrive_whole_and_in_order(pair):
    engine_end, window_end = pair
    writer = FrameWriter(engine_end.fileno())
    # Every send returns at once: the window reads only once all were sent (a sender held for the reader would
    # never get here).
    assert all(writer.send(frame) for frame in frames())
    reader = FrameReader(window_end.fileno())
    assert read_all(reader, len(SIZES)) == frames()
    writer.close()


def test_close_sends_what_is_behind_before_it_returns(pair):
    engine_end, window_end = pair
    writer = FrameWriter(engine_end.fileno())
    received: list = []
    for frame in frames():
        writer.send(frame)
    reading = threading.Thread(target=lambda: received.extend(read_all(FrameReader(window_end.fileno()),
                                                                        len(SIZES) + 1)))
    reading.start()
    writer.close()
    engine_end.close()      # the writer's own socket is closed too: the reader sees the end after the frames
    reading.join(60)
    assert received == [*frames(), None]


def test_a_reader_that_went_is_told_once_and_nothing_more_is_sent(pair):
    engine_end, window_end = pair
    writer = FrameWriter(engine_end.fileno())
    lost: list = []
    writer.on_lost = lambda: lost.append(True)
    window_end.close()
    assert not writer.send(b"after the window went")
    assert not writer.send(b"and again")
    assert lost == [True]
    writer.close()


def test_a_reader_sees_the_end_between_frames():
    engine_end, window_end = socket.socketpair()
    writer = FrameWriter(engine_end.fileno())
    writer.send(b"last")
    writer.close()
    engine_end.close()
    reader = FrameReader(window_end.fileno())
    assert reader.poll(0)
    assert reader.read() == b"last"
    assert reader.read() is None
    window_end.close()


def test_the_window_acknowledges_steps_in_bulk(monkeypatch):
    """Each acknowledgement wakes a thread of the engine process: they cross once ACK_EVERY_STEPS are handled,
    or ACK_INTERVAL_S after the last crossed."""
    engine = EngineProcess(None, EngineConfig(num_blocks=32, block_size=4, max_model_len=128))
    sent: list = []
    monkeypatch.setattr(engine, "_to_child", lambda kind, value: sent.append((kind, value)))
    clock = [1000.0]
    monkeypatch.setattr(process.time, "monotonic", lambda: clock[0])
    engine.ack(1)       # the first crosses: none crossed for longer than the interval
    step = ACK_EVERY_STEPS // 4
    for _ in range(4):
        engine.ack(step)
    assert sent == [(process._ACK, 1), (process._ACK, 4 * step)]
    engine.ack(3)
    assert len(sent) == 2
    clock[0] += process.ACK_INTERVAL_S
    engine.ack(2)
    assert sent[-1] == (process._ACK, 5)
    engine.ack(0)
    assert len(sent) == 3
    engine.close()
