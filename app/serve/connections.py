"""The HTTP layer's own limits, below the ASGI app: how many connections, how long a request's head may take,
how many files the process may open, and how often a failing accept() may be logged.

Without them a client that trickles a header, or opens connections and sends nothing, holds a file
descriptor forever; a thousand of them exhaust the file limit, every new client is then locked out, and asyncio
logs a traceback for each failed accept(), hundreds of megabytes in minutes.
"""

from __future__ import annotations

import ipaddress
import logging
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_DEADLINE_S = 10.0          # from the connection (or the last response) to a request's complete head
ACCEPT_LOG_INTERVAL_S = 10.0    # one "accept() failed" line per this long, with the count it stands for
FILES_KEPT_FREE = 64            # descriptors left for the model, the run log and the KV-event sockets


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (a name other than localhost counts as reachable)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with two deadlines of its own: a connection whose request head has not arrived
    within ``head_deadline_s`` is closed (uvicorn times only the idle wait between requests), and one whose
    client takes no bytes for ``write_stall_s`` while the server has some for it (the socket's buffers full) is
    cut: the response sees the client gone, and its requests are aborted. ``for_server`` sets them."""

    head_deadline_s = HEAD_DEADLINE_S
    write_stall_s = 30.0

    @classmethod
    def for_server(cls, write_stall_s: float) -> type[DeadlineProtocol]:
        return type(cls.__name__, (cls,), {"write_stall_s": write_stall_s})

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._stall_timer = None
        self._arm_head_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.write_stall_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        # abort, not close: close() would wait to hand the client the bytes it is not taking
        self.transport.abort()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self.loop.call_later(self.head_deadline_s, self._head_deadline, self.cycle)

    def _head_deadline(self, cycle_then) -> None:
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()      # no request began since: a stalled or trickled head


def raise_file_limit() -> int:
    """The soft limit on open files raised to the hard one (Linux's default soft limit is 1,024); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass    # not allowed here: keep the soft limit, and size the connection limit under it
    return soft


def connection_limit(wanted: int) -> int:
    """At most ``wanted`` connections, and never more than the open-file limit leaves room for."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - FILES_KEPT_FREE))


class AcceptErrorFilter(logging.Filter):
    """Lets through one of asyncio's "socket.accept() out of system resource" records per interval, saying how
    many it stands for; other records pass."""

    def __init__(self, interval_s: float = ACCEPT_LOG_INTERVAL_S, clock=time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self._last = -float("inf")
        self.num_suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "socket.accept() out of system resource" not in str(record.msg):
            return True
        now = self.clock()
        if now - self._last < self.interval_s:
            self.num_suppressed += 1
            return False
        if self.num_suppressed:
            record.msg = f"{record.msg} (and {self.num_suppressed} more like it in the last {self.interval_s:g} s)"
            self.num_suppressed = 0
        record.exc_info = None      # the same traceback every time: once in the first line is enough
        self._last = now
        return True


def rate_limit_accept_errors() -> AcceptErrorFilter:
    """Install the filter on asyncio's logger, once; returns it."""
    logger = logging.getLogger("asyncio")
    existing = next((f for f in logger.filters if isinstance(f, AcceptErrorFilter)), None)
    if existing is not None:
        return existing
    installed = AcceptErrorFilter()
    logger.addFilter(installed)
    return installed
