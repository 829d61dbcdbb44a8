"""Between the asyncio server and the thread that steps the engine.

One thread steps the engine: EngineLoop here when the server runs headless, or the window's engine worker
when the server shares the app's engine. Either way the bridge hears every step as an engine observer
(LLMEngine.add_observer), so HTTP requests are ordinary engine requests that the window, the run log and the
metrics see like chat turns. Each HTTP request owns a RequestStream: the engine thread hands it outputs with
``call_soon_threadsafe``, and the request's coroutine awaits them.

Engine calls made for the server (add_request, abort_request) never run on the event loop, and run in the order
they were made: an abort sent for a request whose add is still queued runs after that add, so no request is
left running for a client that left. They run on the engine thread between steps (``run_pending``: the
EngineLoop's, or the host's that steps the engine, told by ``on_call``); a thread that waited for the
engine's lock instead would starve, since a busy stepping thread takes the lock again the moment it lets
it go (Python's locks are not fair), and new requests waited 10-30 steps to be added. Prompts are tokenized
before that, on a thread of the event loop's pool (LLMEngine.tokenize), so a long prompt never stalls the steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import NamedTuple

from kvscope.app.serve.errors import APIError
from kvscope.engine.outputs import RequestOutput

log = logging.getLogger("kvscope.serve")
MAX_BUFFERED_PER_REQUEST = 8     # outputs a stream holds per engine request for a reader that is late
IDLE_WAKE_S = 0.25      # the longest the idle loop sleeps, so stop() is quick
STEP_FAILURE_PAUSE_S = 0.05


class StreamClosed(NamedTuple):
    """Put on a stream whose engine went away (the window rebuilt it) instead of a final output."""

    reason: str


class RequestStream:
    """The outputs of one HTTP request's engine requests (several for a batched prompt), in step order.

    Outputs are cumulative (each carries every token and the whole text so far), so a stream need not keep them
    all: it keeps the last MAX_BUFFERED_PER_REQUEST of each engine request, enough for a reader that is a few
    steps late to still send a chunk per step, while a client that stops reading holds a bounded few however
    many steps go by (the older ones are dropped; the newest says everything they said)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_ids: tuple[str, ...]) -> None:
        self.loop = loop
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._buffer: deque[RequestOutput] = deque()    # not yet read, in step order
        self._closed: StreamClosed | None = None
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._wake_queued = False

    def push(self, output: RequestOutput | StreamClosed) -> None:
        """From the engine thread: kept for the reader, within the bound."""
        with self._lock:
            if isinstance(output, StreamClosed):
                self._closed = output
            else:
                self._keep(output)
            if self._wake_queued:
                return      # one wake-up is enough for whatever arrives before the reader runs
            self._wake_queued = True
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:
            pass    # the event loop has closed: the server is gone, and nobody is waiting

    def _keep(self, output: RequestOutput) -> None:
        same = [kept for kept in self._buffer if kept.request_id == output.request_id]
        if len(same) >= MAX_BUFFERED_PER_REQUEST:
            self._buffer.remove(same[0])
        self._buffer.append(output)

    @property
    def num_buffered(self) -> int:
        """Outputs held for the reader: at most MAX_BUFFERED_PER_REQUEST per engine request."""
        with self._lock:
            return len(self._buffer)

    async def next(self) -> list[RequestOutput]:
        """The outputs that came since the last call, in step order; APIError (503) if the engine went away
        before the request finished."""
        await self._ready.wait()
        with self._lock:
            self._ready.clear()
            self._wake_queued = False
            outputs, self._buffer = list(self._buffer), deque()
            closed = self._closed
        if closed is not None:
            self.unfinished.clear()
            raise APIError(503, f"The request was ended: {closed.reason}")
        for output in outputs:
            if output.finished:
                self.unfinished.discard(output.request_id)
        return outputs

    @property
    def finished(self) -> bool:
        return not self.unfinished


class EngineBridge:
    def __init__(self, engine, on_call=None) -> None:
        self.engine = engine
        # A host that steps the engine itself (the window) is told of each call; it then runs run_pending().
        self.on_call = on_call
        self.accepting = True
        self.work = threading.Event()   # set when a request was added: the stepping thread wakes
        self.step_wanted = False        # step even with nothing to run: what happened between steps is reported
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._pending: deque[tuple] = deque()
        self._detach = engine.add_observer(self)

    # --- the engine's observer interface (called from the stepping thread, inside step()) --------------

    def request_added(self, request_id: str, prompt_text: str, num_prompt_tokens: int, n: int) -> None:
        pass

    def step(self, result) -> None:
        with self._lock:
            streams = self._streams
            for output in result.outputs:
                stream = streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del streams[output.request_id]
                stream.push(output)

    # --- called from the event loop ---------------------------------------------------------------------

    async def tokenize(self, prompt):
        """The engine's tokenization of ``prompt`` (its chat template applied to messages), on a thread of the
        event loop's pool: neither the event loop nor the engine thread waits for a long prompt."""
        return await asyncio.to_thread(self.engine.tokenize, prompt)

    async def add(self, prompts: list, params: list, request_ids: list[str]) -> RequestStream:
        """Queue one engine request per prompt, all feeding one stream. All or nothing: if the engine refuses
        one (RequestError), those already added are aborted and the error raised."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(loop, tuple(request_ids))
        with self._lock:
            for request_id in request_ids:
                self._streams[request_id] = stream
        arrival = time.time()   # before the wait for the engine thread, as vLLM's front end stamps its requests
        call = asyncio.wrap_future(self._submit(self._add_all, prompts, params, request_ids, arrival))
        try:
            await asyncio.shield(call)
        except BaseException:
            self.release(stream)    # after the add in the call queue, whether it is done or not
            raise
        self.work.set()
        return stream

    def _submit(self, function, *args) -> Future:
        """Run an engine call on the engine thread between steps, after every call submitted before it."""
        future: Future = Future()
        self._pending.append((function, args, future))
        self.work.set()
        if self.on_call is not None:
            self.on_call()
        return future

    def run_pending(self) -> None:
        """The engine thread, between steps: the calls submitted so far, in order."""
        while self._pending:
            function, args, future = self._pending.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(*args))
                except BaseException as exc:
                    future.set_exception(exc)

    def _add_all(self, prompts: list, params: list, request_ids: list[str], arrival: float) -> None:
        for prompt, sampling, request_id in zip(prompts, params, request_ids):
            self.engine.add_request(prompt, sampling, request_id=request_id, arrival_time=arrival)

    def release(self, stream: RequestStream) -> None:
        """The request's coroutine is done with the stream: abort what has not finished (a client that left,
        a refused batch). Safe from any thread; returns at once."""
        with self._lock:
            for request_id in stream.request_ids:
                self._streams.pop(request_id, None)
        for request_id in tuple(stream.unfinished):
            self._submit(self.engine.abort_request, request_id)
        self.work.set()

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (False while a request holds blocks); the stepping thread then takes one
        step, so the AllBlocksCleared event goes out now rather than with the next request."""
        done = await asyncio.wrap_future(self._submit(self.engine.reset_prefix_cache))
        if done:
            self.step_wanted = True
            self.work.set()
        return done

    def abort_all(self) -> list[str]:
        """Stop taking requests and abort those in flight: their final outputs (finish_reason "abort") reach
        their clients with the next step. For shutdown; returns the aborted request ids."""
        self.accepting = False
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._submit(self.engine.abort_request, request_id)
        self.work.set()
        return request_ids

    def close_streams(self, reason: str) -> None:
        """The engine is going away without being stepped again: end every stream now, saying why."""
        self.accepting = False
        with self._lock:
            streams, self._streams = set(self._streams.values()), {}
        for stream in streams:
            stream.push(StreamClosed(reason))

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def close(self) -> None:
        self.run_pending()      # whatever the engine loop left (it has stopped): aborts, mostly
        self._detach()


class EngineLoop:
    """Steps the engine while it has work: the headless server's engine thread."""

    def __init__(self, engine, bridge: EngineBridge) -> None:
        self.engine = engine
        self.bridge = bridge
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-serve-engine", daemon=True)
        self.num_failed_steps = 0

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        engine, bridge = self.engine, self.bridge
        while not self._stop.is_set():
            bridge.run_pending()
            if engine.has_unfinished_requests() or bridge.step_wanted:
                bridge.step_wanted = False
                self._step()
            else:
                bridge.work.wait(IDLE_WAKE_S)
                bridge.work.clear()

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as exc:
            # The engine has failed the requests this step touched (finish_reason "error", reported by the
            # next step) and left the pool consistent; everyone else goes on.
            self.num_failed_steps += 1
            log.error("engine step failed: %s: %s", type(exc).__name__, exc)
            time.sleep(STEP_FAILURE_PAUSE_S)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until the engine has nothing unfinished (every final output delivered)."""
        deadline = time.monotonic() + timeout_s
        while self.engine.has_unfinished_requests():
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.01)
        return True

    def stop(self) -> None:
        self._stop.set()
        self.bridge.work.set()
        if self._thread.is_alive():
            self._thread.join()
