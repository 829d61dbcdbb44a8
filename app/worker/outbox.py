"""How the engine process's messages cross to the window: length-prefixed frames on the pipe's socket, sent by
whichever thread posts them, at once, and by a thread of their own only while the window is behind.

A thread of the engine process that wakes while the engine steps costs the engine more than its own work: it
waits for the interpreter lock, and is signalled awake each time the engine thread lets go of it (numpy does,
around each bigger array). A thread that only slept and woke 40 times a second cost an engine stepping 256
requests on 330,000 blocks 3.4% and 4.4% of its steps (two runs; thread CPU, one process, alternated). A writer
thread woke for every post, and the thread that takes the window's commands for every acknowledgement. So a post
is sent without waiting, into a send buffer sized for a dozen busy posts (SEND_BUFFER, where the system allows
it), and the writer thread wakes only when that buffer is full: the window has fallen behind, and the engine must
not wait for it. The window acknowledges in bulk (EngineProcess.ack).

The window's side reads the frames (FrameReader); what the window sends the engine (commands, acknowledgements)
still crosses the same socket the other way as multiprocessing's Connection frames them.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import struct
import threading
from collections.abc import Callable

SEND_BUFFER = 2 << 20       # bytes asked for; Linux doubles it and caps it at net.core.wmem_max (often 4 MiB)
_LENGTH = struct.Struct("!Q")
JOIN_S = 10.0


class FrameWriter:
    """Sends each frame without waiting, in the order ``send`` is called (from any thread); what the socket does
    not take at once goes to a writer thread, and so does every frame after it until it has all been sent.
    ``on_lost`` is called, once, when the reader has gone; ``send`` then returns False."""

    def __init__(self, fd: int) -> None:
        self._socket = socket.socket(fileno=os.dup(fd))
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        except OSError:     # the system's default buffer: the writer thread wakes more often, nothing else
            pass
        self._lock = threading.Condition()
        self._behind: collections.deque[memoryview] = collections.deque()    # for the writer thread, in order
        self._closing = False
        self._lost = False
        self.on_lost: Callable[[], None] = lambda: None
        self._writer = threading.Thread(target=self._write_behind, name="engine-outbox", daemon=True)
        self._writer.start()

    def send(self, data: bytes) -> bool:
        header = _LENGTH.pack(len(data))
        with self._lock:
            if self._lost:      # nobody is left to read it
                return False
            sent = 0
            if not self._behind:    # else it waits its turn behind what the writer thread has
                try:
                    sent = self._socket.sendmsg([header, data], [], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass
                except OSError:
                    return self._lose()
            if sent < len(header) + len(data):
                self._behind.append(memoryview(header + data)[sent:])
                self._lock.notify()
            return True

    def _write_behind(self) -> None:
        while True:
            with self._lock:
                while not self._behind and not self._closing:
                    self._lock.wait()
                if not self._behind:    # closing, and everything was sent
                    return
                frame = self._behind[0]
            try:
                self._socket.sendall(frame)     # waits for the window, on this thread only
            except OSError:
                with self._lock:
                    self._lose()
                return
            with self._lock:
                self._behind.popleft()

    def _lose(self) -> bool:
        """The window is gone (called holding the lock, so ``on_lost`` must not send)."""
        if not self._lost:
            self._lost = True
            self._behind.clear()
            self.on_lost()
        return False

    def close(self) -> None:
        """Send what was posted (the run's last messages), then stop."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._writer.join(JOIN_S)
        self._socket.close()


class FrameReader:
    """The window's side: the frames a FrameWriter sent, in order, read from the file descriptor of the
    connection that owns the socket."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def poll(self, timeout: float | None) -> bool:
        """Whether a frame (or the end) can be read within ``timeout`` seconds (None: for ever)."""
        readable, _, _ = select.select([self._fd], [], [], timeout)
        return bool(readable)

    def read(self) -> bytearray | None:
        """The next frame, or None once the writer's end has closed."""
        header = self._exactly(_LENGTH.size)
        return None if header is None else self._exactly(_LENGTH.unpack(header)[0])

    def _exactly(self, size: int) -> bytearray | None:
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            try:
                received = os.readv(self._fd, [view[got:]])
            except OSError:
                return None
            if not received:
                return None
            got += received
        return buffer
