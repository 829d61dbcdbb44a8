"""Servers that misbehave on purpose, on 127.0.0.1, for the tests of what kvscope attach takes from outside.

HostileHTTP answers each path with a behaviour: a whole page, a page that
trickles a byte at a time and never ends, one that streams without end, or
silence. HostilePublisher is a KV-event publisher whose replay socket stays
silent or answers without end. Every one stops by itself: a connection's
thread gives up when the client goes, when the server is closed, or after
LIFETIME_S, so a test that fails half-way leaves nothing running.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
from vllm_fakes import FakePublisher

LIFETIME_S = 30.0

Behaviour = Callable[["Connection"], None]


class Connection:
    """One client connection, as a behaviour sees it: it writes until told to stop or the client goes."""

    def __init__(self, sock: socket.socket, closing: threading.Event) -> None:
        self.sock = sock
        self._closing = closing
        self._until = time.monotonic() + LIFETIME_S

    @property
    def going(self) -> bool:
        return not self._closing.is_set() and time.monotonic() < self._until

    def send(self, data: bytes) -> bool:
        """False once the client has gone."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def wait(self, seconds: float) -> None:
        self._closing.wait(seconds)


def head(status: int = 200, length: int | None = None, kind: str = "text/plain; version=0.0.4") -> bytes:
    lines = [f"HTTP/1.1 {status} OK", f"content-type: {kind}", "connection: close"]
    if length is not None:
        lines.append(f"content-length: {length}")     # else the body ends when the connection does
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def page(body: str | bytes, status: int = 200, kind: str = "text/plain; version=0.0.4") -> Behaviour:
    data = body.encode() if isinstance(body, str) else body

    def answer(conn: Connection) -> None:
        conn.send(head(status, len(data), kind) + data)
    return answer


def trickle(every_s: float = 0.2, declared: int = 60_000) -> Behaviour:
    """Headers, then one byte every ``every_s``, for ever: each read returns, so no read timeout fires."""
    def answer(conn: Connection) -> None:
        if not conn.send(head(200, declared)):
            return
        while conn.going and conn.send(b"v"):
            conn.wait(every_s)
    return answer


def endless(line: bytes = b'vllm:num_requests_running{engine="0"} 0.0\n', declared: int | None = None) -> Behaviour:
    """A page that streams ``line`` without end (or says it is ``declared`` bytes long)."""
    def answer(conn: Connection) -> None:
        if not conn.send(head(200, declared)):
            return
        block = line * max(1, 65536 // len(line))
        while conn.going and conn.send(block):
            pass
    return answer


def silent(conn: Connection) -> None:
    while conn.going and not _closed_by_peer(conn.sock):
        conn.wait(0.05)


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        sock.setblocking(False)
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


class HostileHTTP:
    """``routes``: path -> behaviour, changeable while it runs. Counts the connections still open."""

    def __init__(self, routes: dict[str, Behaviour]) -> None:
        self.routes = dict(routes)
        self.open = 0
        self.requests: list[str] = []
        self._closing = threading.Event()
        self._lock = threading.Lock()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            block_on_close = False
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        with self._lock:
            self.open += 1
        try:
            request = b""
            while b"\r\n\r\n" not in request and len(request) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    return
                request += chunk
            path = request.split(b" ", 2)[1].decode(errors="replace")
            self.requests.append(path)
            behaviour = self.routes.get(path) or page(b'{"detail":"Not Found"}', 404, "application/json")
            behaviour(Connection(sock, self._closing))
        except OSError:
            pass
        finally:
            with self._lock:
                self.open -= 1

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(2)


def batch(events: list, rank: int | None = 0, ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, events, rank])


class HostilePublisher(FakePublisher):
    """vLLM's KV-event sockets whose replay socket is ``silent`` (never answers) or answers ``endless``-ly."""

    def __init__(self, context: zmq.Context, mode: str, payload: bytes = b"") -> None:
        self.mode, self.payload = mode, payload or batch([])
        self.num_replies = 0
        # A send to a peer that left raises, rather than queueing for nobody.
        super().__init__(context, router_options=((zmq.SNDHWM, 1000), (zmq.ROUTER_MANDATORY, 1)))

    def _serve_replays(self) -> None:
        until = time.monotonic() + LIFETIME_S
        client, seq = None, 0
        while not self._stop.is_set() and time.monotonic() < until:
            if self.router.poll(0 if client is not None else 50):
                client, _, start = self.router.recv_multipart()
                seq = int.from_bytes(start, "big", signed=True)
                self.replay_requests.append(seq)
            if self.mode != "endless" or client is None:
                continue
            try:    # as fast as the socket takes them, never blocking: the peer may be gone
                self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), self.payload],
                                           flags=zmq.NOBLOCK)
                seq += 1
                self.num_replies += 1
            except zmq.Again:
                self._stop.wait(0.001)
            except zmq.ZMQError:
                client = None   # the requester has gone
