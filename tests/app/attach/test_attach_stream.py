"""The event subscriber against a publisher speaking vLLM's wire protocol with recorded payloads:
bootstrap replay, gaps, restarts, duplicates and malformed messages."""

from __future__ import annotations

import pytest
import zmq
from vllm_fakes import SHARED, FakePublisher, recorded_payloads, until

from kvscope.app.attach.feed.recording import read_messages
from kvscope.app.attach.feed.replay import request_replay
from kvscope.app.attach.feed.server import EventEndpoint
from kvscope.app.attach.feed.subscriber import Delivery, EventStream, Reset

PAYLOADS = recorded_payloads()


OPENED: list[EventStream] = []


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    while OPENED:
        OPENED.pop().close()
    context.destroy(linger=0)


@pytest.fixture
def publisher(context):
    publisher = FakePublisher(context)
    yield publisher
    publisher.close()


def open_stream(context, publisher, *, replay=True) -> EventStream:
    stream = EventStream(context, EventEndpoint(publisher.endpoint, publisher.replay_endpoint if replay else None,
                                                topic="kv-events"), idle_s=2.0)
    OPENED.append(stream)
    publisher.wait_for_subscriber()
    return stream


def bootstrap(stream: EventStream) -> list:
    stream.bootstrap()
    return stream.wait_for_replay()


def drain_until(stream: EventStream, count: int) -> list:
    got: list = []
    until(lambda: got.extend(stream.drain()) or sum(type(i) is Delivery for i in got) >= count)
    return got


def seqs(items) -> list[int]:
    return [i.seq for i in items if type(i) is Delivery]


def test_the_replay_socket_answers_like_the_recorded_server(context, publisher):
    recorded = list(read_messages(SHARED / "kv-replay.frames.jsonl"))
    for seq, payload in enumerate(PAYLOADS):
        publisher.publish(seq, payload, live=False)
    result = request_replay(context, publisher.replay_endpoint, 0)
    assert result.complete and len(result.batches) == len(recorded) - 1 == 87
    assert [(s, p) for s, p in result.batches] == \
           [(int.from_bytes(f[2], "big"), f[3]) for f in recorded[:-1]]
    assert recorded[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert [s for s, _ in request_replay(context, publisher.replay_endpoint, 80).batches] == list(range(80, 87))


def test_bootstrap_replays_what_the_server_buffered_before_kvscope_came(context, publisher):
    for seq, payload in enumerate(PAYLOADS[:40]):
        publisher.publish(seq, payload, live=False)
    stream = open_stream(context, publisher)
    assert seqs(bootstrap(stream)) == list(range(40))
    publisher.publish(40, PAYLOADS[40])
    assert seqs(drain_until(stream, 1)) == [40]
    status = stream.status()
    assert (status.first_seq, status.last_seq, status.num_replayed, status.num_gaps) == (0, 40, 40, 0)


def test_live_copies_of_replayed_batches_are_skipped_not_taken_for_a_restart(context, publisher):
    stream = open_stream(context, publisher)
    for seq, payload in enumerate(PAYLOADS[:5]):
        publisher.publish(seq, payload)      # live, and buffered: the live copies wait in the socket
    until(lambda: stream.socket.poll(0))
    assert seqs(bootstrap(stream)) == list(range(5))
    publisher.publish(5, PAYLOADS[5])
    items = drain_until(stream, 1)
    assert seqs(items) == [5] and not any(type(i) is Reset for i in items)
    assert stream.status().num_restarts == 0


def test_a_gap_is_filled_by_replay_from_the_last_seq_seen(context, publisher):
    stream = open_stream(context, publisher)
    bootstrap(stream)
    publisher.publish(0, PAYLOADS[0])
    drain_until(stream, 1)
    publisher.publish(1, PAYLOADS[1], live=False)    # dropped on the way: only the replay buffer has it
    publisher.publish(2, PAYLOADS[2], live=False)
    publisher.publish(3, PAYLOADS[3])
    assert seqs(drain_until(stream, 3)) == [1, 2, 3]
    assert publisher.replay_requests[-1] == 1
    status = stream.status()
    assert (status.num_gaps, status.num_lost, status.num_replayed) == (1, 0, 3)   # 3 too: it was buffered


def test_batches_gone_from_the_buffer_are_counted_lost(context, publisher):
    stream = open_stream(context, publisher, replay=False)
    publisher.publish(0, PAYLOADS[0])
    publisher.publish(4, PAYLOADS[4])
    assert seqs(drain_until(stream, 2)) == [0, 4]
    status = stream.status()
    assert (status.num_gaps, status.num_lost) == (1, 3)


def test_the_sequence_going_back_means_the_server_restarted(context, publisher):
    stream = open_stream(context, publisher)
    bootstrap(stream)
    for seq, payload in enumerate(PAYLOADS[:10]):
        publisher.publish(seq, payload)
    drain_until(stream, 10)
    publisher.restart()
    run2 = recorded_payloads(SHARED / "run2" / "kv-events.frames.jsonl")
    publisher.publish(0, run2[0], live=False)
    publisher.publish(1, run2[1])
    items = drain_until(stream, 2)
    assert type(items[0]) is Reset and "went back from 9 to 1" in items[0].reason
    assert seqs(items) == [0, 1]        # the new server's buffer replayed from 0
    assert stream.status().num_restarts == 1


def test_malformed_messages_are_counted_and_the_stream_goes_on(context, publisher):
    stream = open_stream(context, publisher, replay=False)
    publisher.send_raw([b"kv-events", b"\x00"])                          # seq not 8 bytes
    publisher.send_raw([b"kv-events"])                                   # one frame
    publisher.publish(0, b"\x93\x01")                                    # truncated msgpack
    publisher.publish(1, PAYLOADS[1])
    items = drain_until(stream, 1)
    assert seqs(items) == [1]
    status = stream.status()
    assert status.num_malformed == 3 and status.last_seq == 1 and status.num_batches == 1


def test_a_replay_endpoint_that_does_not_answer_times_out(context):
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    try:
        result = request_replay(context, router.getsockopt_string(zmq.LAST_ENDPOINT), 0, timeout_s=0.2)
        assert not result.complete and result.batches == ()
    finally:
        router.close(linger=0)


def test_binding_when_vllm_connects(context):
    stream = EventStream(context, EventEndpoint("tcp://127.0.0.1:*", bind=True))
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.connect(stream.socket.getsockopt_string(zmq.LAST_ENDPOINT))
        got: list = []

        def received() -> bool:
            pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), PAYLOADS[0]])
            got.extend(stream.drain())
            return bool(got)

        until(received)
        assert seqs(got)[0] == 0 and stream.error is None
    finally:
        pub.close(linger=0)
        stream.close()
