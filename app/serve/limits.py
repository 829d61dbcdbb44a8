"""What keeps one client from exhausting the server: bounds on request bodies, on requests in flight, on the
prompt tokens they hold, on how long a stalled stream may wait, and the API key.

The body bound is an ASGI middleware: a declared Content-Length over the bound is refused before a byte is
read, and a chunked body is refused as soon as it passes the bound, so memory never holds more than the bound.
The key is compared in constant time (hmac.compare_digest), so response timing says nothing about it.
"""

from __future__ import annotations

import asyncio
import hmac

from kvscope.app.serve.errors import APIError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_CONCURRENT_REQUESTS = 512
DEFAULT_WRITE_STALL_S = 30.0        # a streaming client that takes no bytes this long is dropped
BODY_READ_DEADLINE_S = 30.0         # a body that stops arriving this long is refused with 408
PROMPT_BUDGET_POOLS = 4             # prompt tokens in flight: this many KV pools' worth


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit:,} bytes; "
                         "kvscope serve --max-request-bytes sets it)")


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413, and one that stops arriving with 408.

    Before answering, what the client is still sending is read and dropped, up to DRAIN_BYTES: a server that
    closes a connection with unread data makes the kernel reset it, and the client would see a broken
    connection instead of the 413 that says why."""

    DRAIN_BYTES = 1024 * 1024
    DRAIN_S = 1.0       # and for at most this long: a client that declared a huge body and sends nothing gets
                        # its 413 at once

    def __init__(self, app, limit: int, read_deadline_s: float = BODY_READ_DEADLINE_S) -> None:
        self.app = app
        self.limit = limit
        self.read_deadline_s = read_deadline_s     # the longest wait for each piece of a body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._drain(receive, more=True)
            await body_too_large(self.limit).response()(scope, receive, send)
            return
        received, body_done = 0, False

        async def bounded_receive():
            nonlocal received, body_done
            if body_done:   # past the body, receive() waits for the client to leave: no deadline on that
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_deadline_s)
            except asyncio.TimeoutError:
                raise APIError(408, f"The request body did not arrive: nothing came for {self.read_deadline_s:g} "
                                    "s") from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > self.limit:
                    await self._drain(receive, message.get("more_body", False))
                    raise body_too_large(self.limit)    # the app's APIError handler answers it
            return message

        await self.app(scope, bounded_receive, send)

    async def _drain(self, receive, more: bool) -> None:
        try:
            await asyncio.wait_for(self._drop(receive, more), self.DRAIN_S)
        except asyncio.TimeoutError:
            pass

    async def _drop(self, receive, more: bool) -> None:
        dropped = 0
        while more and dropped < self.DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            more = message.get("more_body", False)


class ConcurrencyLimit:
    """Generation requests in flight, at most ``limit``; one over it is refused with 503 and Retry-After."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def acquire(self) -> None:
        """Take a slot (event-loop thread only), or raise the refusal."""
        if self.in_flight >= self.limit:
            raise APIError(503, f"The server is busy: it is already serving its maximum of {self.limit} "
                                "requests at once (kvscope serve --max-concurrent-requests); retry shortly",
                           headers={"retry-after": "1"})
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


class PromptTokenBudget:
    """Prompt tokens held by the requests in flight, at most ``limit`` (a few pools' worth: more could not run
    soon anyway, and each token held costs memory); one request over it is refused with 503 and Retry-After.
    A request larger than the whole budget is let in alone, when nothing else holds any, so it is not
    starved (the body limit bounds it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def admit(self, num_tokens: int):
        """Take ``num_tokens`` (event-loop thread only); returns the release, safe to call once."""
        if self.held and self.held + num_tokens > self.limit:
            raise APIError(503, f"The server is busy: the requests in flight already hold {self.held:,} prompt "
                                f"tokens of its budget of {self.limit:,}; retry shortly", headers={"retry-after": "1"})
        self.held += num_tokens
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self.held -= num_tokens
        return release


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Raise 401 unless ``authorization`` is ``Bearer <expected>``; anything goes when no key is set."""
    if expected is None:
        return
    if not authorization:
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' (the openai "
                            "client's api_key).")
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise APIError(401, "Incorrect API key provided.")
