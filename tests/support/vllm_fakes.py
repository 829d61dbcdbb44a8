"""Stand-ins for a vLLM server, fed with what real vLLM servers sent (tests/data/vllm/).

FakeServer answers /metrics, /version, /v1/models and /kv_event_sources over
HTTP from recorded pages. FakePublisher speaks vLLM's event wire protocol (an
XPUB socket, so a test can wait until the subscriber has joined, and a ROUTER
replay socket serviced by its own thread) and sends recorded payloads, with
the sequence numbers a test chooses: in order, with a gap, or starting over.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import zmq

from kvscope.app.attach.feed.recording import live_messages

DATA = Path(__file__).parents[1] / "data" / "vllm"
SHARED = DATA / "shared-run"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def recorded_payloads(path: Path = SHARED / "kv-events.frames.jsonl") -> list[bytes]:
    return [payload for _, _, payload in live_messages(path)]


def timeseries_pages(path: Path = SHARED / "metrics-timeseries.txt") -> list[tuple[float, str]]:
    """(time, page) of each sample of a recorded time series."""
    pages = []
    for chunk in path.read_text().split("# t=")[1:]:
        stamp, _, body = chunk.partition("\n")
        pages.append((float(stamp), body))
    return pages


class FakePublisher:
    """vLLM's KV-event sockets: an XPUB for live batches and a ROUTER that replays the buffer from a seq.

    tests/support/hostile_fakes.py's HostilePublisher is this one with a replay socket that misbehaves."""

    def __init__(self, context: zmq.Context, topic: bytes = b"kv-events", *, router_options=()) -> None:
        self.topic = topic
        self.pub = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        for option, value in router_options:
            self.router.setsockopt(option, value)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    def wait_for_subscriber(self, timeout_s: float = 5.0) -> None:
        if not self.pub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no subscriber joined")
        self.pub.recv()

    def publish(self, seq: int, payload: bytes, *, live: bool = True, buffered: bool = True) -> None:
        """``live=False`` keeps it only for replay (the subscriber sees a gap)."""
        if buffered:
            with self._lock:
                self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """The server started over: its buffer is empty and seq counts from 0 again."""
        with self._lock:
            self.buffer.clear()

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            with self._lock:
                batches = [(s, p) for s, p in self.buffer if s >= start_seq]
            for seq, payload in batches:
                self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(linger=0)
        self.router.close(linger=0)


class FakeServer:
    """A vLLM HTTP front end that serves recorded pages; ``metrics`` may be changed between requests."""

    def __init__(self, metrics: str, *, sources: dict | None = None, version: str = "0.32.0",
                 model_root: str | None = None) -> None:
        self.metrics = metrics
        self.sources = sources
        self.version = version
        self.model_root = model_root
        self.status = 200
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
                body, kind, status = server.answer(self.path)
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._handler = Handler
        self.port = 0
        self.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Listen (again, on the same port after stop(): the server came back)."""
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The server is gone: connections are refused."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(2)

    def answer(self, path: str) -> tuple[bytes, str, int]:
        if path == "/metrics":
            return self.metrics.encode(), "text/plain; version=0.0.4", self.status
        if path == "/version":
            return json.dumps({"version": self.version}).encode(), "application/json", 200
        if path == "/v1/models":
            card = {"id": "smollm2", "object": "model", "root": self.model_root, "max_model_len": 1024}
            return json.dumps({"object": "list", "data": [card]}).encode(), "application/json", 200
        if path == "/kv_event_sources" and self.sources is not None:
            return json.dumps(self.sources).encode(), "application/json", 200
        return b'{"detail":"Not Found"}', "application/json", 404

    def close(self) -> None:
        if self._thread.is_alive():
            self.stop()


def until(predicate, timeout_s: float = 5.0, step_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(step_s)
