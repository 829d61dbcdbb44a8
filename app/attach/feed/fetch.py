"""Every HTTP request to the watched server: a total deadline, a byte cap, and a way to stop it at once.

A blocking client cannot do this: httpx's read timeout applies to each read, so
a page that sends a byte every two seconds keeps one GET alive forever, and a
thread blocked in a read cannot be told to give up. Here the requests run on an
asyncio event loop in a thread of their own; the caller waits for the answer
in short slices and cancels the request when its deadline passes or stop() is
called, which closes its connection. Cancelling is immediate whatever the
server does, so the window's data source can always be stopped within a
fraction of a second.

The body is read as it streams and refused as soon as it passes the cap (or
when its Content-Length says it will), so a huge page is never held whole.
Responses are asked for uncompressed; the cap counts decoded bytes either way.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import httpx

CONNECT_TIMEOUT_S = 3.0
STOP_CHECK_S = 0.05         # how often a waiting caller looks at stop()
CLOSE_TIMEOUT_S = 1.0


class FetchError(Exception):
    """The request got no whole, acceptable answer; the message says why in a few words. ``unreachable``:
    nothing answered at all (refused, or no such host)."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class Stopped(FetchError):
    """stop() was called while the request was in flight."""


@dataclass(frozen=True)
class Page:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class Fetcher:
    """An httpx.AsyncClient on a private event loop, used from any thread through the blocking ``get``."""

    def __init__(self) -> None:
        self._closed = False
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvscope-attach-http", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(_make_client(), CLOSE_TIMEOUT_S * 5)

    def _call(self, coroutine, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get(self, url: str, *, max_bytes: int, deadline_s: float, stop: threading.Event | None = None) -> Page:
        """The whole answer to GET ``url``, within ``deadline_s`` and ``max_bytes``, or FetchError;
        Stopped as soon as ``stop`` is set."""
        if self._closed or (stop is not None and stop.is_set()):
            raise Stopped("stopped")
        future: Future = asyncio.run_coroutine_threadsafe(self._read(url, max_bytes), self._loop)
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                return future.result(min(STOP_CHECK_S, max(deadline - time.monotonic(), 0.0)))
            except FutureTimeout:
                pass
            if stop is not None and stop.is_set():
                future.cancel()
                raise Stopped("stopped")
            if time.monotonic() >= deadline:
                future.cancel()
                raise FetchError(f"no whole answer in {deadline_s:g} s")

    async def _read(self, url: str, max_bytes: int) -> Page:
        try:
            async with self._client.stream("GET", url) as response:
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise FetchError(f"an answer of {int(declared):,} bytes (kvscope reads at most {max_bytes:,})")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise FetchError(f"an answer past {max_bytes:,} bytes (kvscope reads at most that)")
                return Page(response.status_code, bytes(body))
        except httpx.HTTPError as exc:
            raise FetchError(describe_http_error(exc), isinstance(exc, httpx.ConnectError)) from None

    def close(self) -> None:
        """Cancel what is in flight and end the loop's thread. Idempotent; safe from any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._call(self._client.aclose(), CLOSE_TIMEOUT_S)
        except Exception:   # a connection that will not close politely is dropped with the loop
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()


async def _make_client() -> httpx.AsyncClient:
    # The read timeout only bounds one read; the caller's deadline bounds the request.
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), follow_redirects=True,
                             headers={"user-agent": "kvscope-attach", "accept-encoding": "identity"})


def describe_http_error(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or host not found"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
        return f"the connection was lost ({exc or type(exc).__name__})"
    return str(exc) or type(exc).__name__
