"""The attach data source: one thread that watches a vLLM server and hands out AttachFrames.

The thread polls ``/metrics`` every interval and waits on the event sockets in
between, so events are applied as they arrive and a frame goes out as soon as
something changed: at every metrics sample, and between samples at most
FRAME_RATE times a second, fewer when frames of a big pool cost more than
FRAME_CPU_BUDGET of a core to build. The UI thread only ever receives frames.

When ``/metrics`` stops answering, the frames say "disconnected, retrying" and
the next tries back off (BACKOFF_S). When it answers again, a changed process
start time (or counters that went backwards) means the server restarted: the
pools are cleared, the window is told, and each publisher's buffer is replayed
from 0. A sequence number going backwards says the same from the event side.
A page that answers but is not plausible (metrics.sample_problem: numbers out of
range, series that vanished) is a bad sample: counted, shown, and skipped, never
taken for a restart. Every metrics sample is also a step of the run log, with
what the events did since the previous one; the first is the baseline, so the
session is credited only with what the server did while it was watched.

Nothing here waits on the server: a request has a total deadline and stop()
cancels it (fetch.py), replays are read as they arrive (replay.py), and the
loop wakes at least every IDLE_WAKE_S, so stop() ends the thread in well under
a second. An exception in a tick (a bug, never the server's input) is shown
as a notice and the thread goes on; it never ends silently with the window
still drawing its last frame.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

import zmq

from kvscope.app.attach.feed.fetch import Fetcher, FetchError, Stopped
from kvscope.app.attach.feed.frame import (
    CONNECTED,
    DISCONNECTED,
    AttachFrame,
    BadSamples,
    Connection,
    Notice,
    QueuePoint,
)
from kvscope.app.attach.feed.limits import MAX_BLOCKS, MAX_RANKS
from kvscope.app.attach.feed.metrics import MetricsSample
from kvscope.app.attach.feed.pool_set import PoolSet
from kvscope.app.attach.feed.pool_view import PoolView
from kvscope.app.attach.feed.rates import RateWindow, ServerRates
from kvscope.app.attach.feed.run_log import step_stats
from kvscope.app.attach.feed.server import BadPage, ServerInfo, fetch_metrics
from kvscope.app.attach.feed.subscriber import Delivery, EventStream
from kvscope.engine.outputs import StepStats

FRAME_RATE = 10
FRAME_CPU_BUDGET = 0.03
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
QUEUE_HISTORY = 120
NOTICES_KEPT = 5
IDLE_WAKE_S = 0.25      # the longest the thread sleeps, so stop() is quick
# Events are taken in batches at most this often: each wake-up costs a poll and a pass over the
# sockets, and a busy server sends thousands of messages a second; a person sees no 20 ms delay.
DRAIN_EVERY_S = 0.02
FAULT_PAUSE_S = 1.0     # after a tick that raised, before the next


class AttachSource:
    def __init__(self, server: ServerInfo, *, client: Fetcher | None = None,
                 publish: Callable[[AttachFrame], None], interval_s: float = 1.0,
                 run_log=None, preview_text=None, preview_note: str = "") -> None:
        self.server = server
        self.client = client
        self.publish = publish
        self.interval_s = interval_s
        self.run_log = run_log
        self.preview_text = preview_text
        self.preview_note = preview_note
        self.pools = PoolSet(server, preview_text)
        self.window = RateWindow()
        self.connection = Connection(CONNECTED)
        self.streams: list[EventStream] = []
        self.sample: MetricsSample | None = None
        self.rates: ServerRates | None = None
        self.stats: StepStats | None = None
        self.sample_index = 0
        self.frame_index = 0
        self.history: deque[QueuePoint] = deque(maxlen=QUEUE_HISTORY)
        self.notices: deque[Notice] = deque(maxlen=NOTICES_KEPT)
        self.bad_samples = BadSamples()
        self._dirty = False
        self._failures = 0
        self._lost_batches = 0
        self._refused: set[tuple[int, int]] = set()
        self._next_sample = 0.0
        self._next_frame = 0.0
        self._stopping = threading.Event()
        self.finished = threading.Event()   # run() has closed its sockets and the run log
        self._context: zmq.Context | None = None

    # --- the thread ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping.set()

    def run(self, first_sample: MetricsSample | None = None) -> None:
        """The thread's body: returns once stop() is called. Sockets live and die in this thread."""
        self._context = zmq.Context()
        try:
            self.open_streams()
            if first_sample is not None:
                self.take_sample(first_sample)
                self._next_sample = time.monotonic() + self.interval_s
            self.bootstrap_streams()
            while not self._stopping.is_set():
                try:
                    self._tick()
                except Exception as exc:
                    self._fault(exc)
        finally:
            for stream in self.streams:
                stream.close()
            self._context.term()
            if self.run_log is not None:
                self.run_log.close()
            self.finished.set()

    def _fault(self, exc: Exception) -> None:
        """A tick raised: kvscope's bug, not the server's. Say so where the user looks, and go on."""
        where = traceback.extract_tb(exc.__traceback__)[-1]
        self.notice(f"internal error, the watch goes on: {type(exc).__name__}: {exc} "
                    f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")
        self._publish()
        self._stopping.wait(FAULT_PAUSE_S)

    def _tick(self) -> None:
        if time.monotonic() >= self._next_sample:
            self.poll_metrics()
        self.publish_if_due()
        wake = min(self._next_sample, self._next_frame if self._dirty else float("inf"),
                   time.monotonic() + IDLE_WAKE_S)
        timeout_ms = max(0, int((wake - time.monotonic()) * 1000))
        if not self.streams or self._stopping.is_set():
            self._stopping.wait(timeout_ms / 1000)
            return
        poller = zmq.Poller()
        for stream in self.streams:
            poller.register(stream.waiting_on, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        for index, stream in enumerate(self.streams):
            # A replay in flight is looked at on every tick: its deadlines pass without a message.
            if stream.waiting_on in ready or stream.replay is not None:
                self.apply(index, stream.drain())
            stream.check_link()
        if ready:
            self._stopping.wait(DRAIN_EVERY_S)

    def open_streams(self, context: zmq.Context | None = None) -> None:
        context = context or self._context
        self.streams = [EventStream(context, source) for source in self.server.event_sources]
        for stream in self.streams:
            if stream.error:
                self.notice(stream.error)

    def bootstrap_streams(self, wait: bool = False) -> None:
        """Ask each publisher for what it still buffers, so a busy server's pool shows at once. The replies
        come with the live messages (``wait``: take them now, for tests and tools)."""
        for index, stream in enumerate(self.streams):
            stream.bootstrap()
            if wait:
                self.apply(index, stream.wait_for_replay())

    # --- metrics ------------------------------------------------------------------------------

    def poll_metrics(self) -> None:
        try:
            sample = fetch_metrics(self.client, self.server.url, self.sample, self._stopping)
        except Stopped:
            return
        except FetchError as exc:
            self._lost(str(exc))
            return
        except BadPage as exc:
            self._bad_sample(str(exc).removeprefix(f"{self.server.url}: "))
            return
        if self.connection.state == DISCONNECTED:
            self.notice(f"reconnected to {self.server.url}")
        self._failures = 0
        self.connection = Connection(CONNECTED)
        self._next_sample = time.monotonic() + self.interval_s
        self.take_sample(sample)

    def _bad_sample(self, reason: str) -> None:
        """The server answered with a page kvscope cannot believe: skip it, count it, say so once a run."""
        if self.bad_samples.in_a_row == 0:
            self.notice(f"a bad /metrics page was skipped: {reason}")
        self.bad_samples = self.bad_samples.add(reason)
        self._failures = 0
        self.connection = Connection(CONNECTED)
        self._next_sample = time.monotonic() + self.interval_s
        self._publish()

    def _lost(self, reason: str) -> None:
        delay = BACKOFF_S[min(self._failures, len(BACKOFF_S) - 1)]
        if self.connection.state != DISCONNECTED:
            self.notice(f"lost {self.server.url}: {reason}")
        self._failures += 1
        self.connection = Connection(DISCONNECTED, reason, delay)
        self._next_sample = time.monotonic() + delay
        self._publish()

    def take_sample(self, sample: MetricsSample) -> None:
        """One metrics sample: a run log step and a frame."""
        if self.sample is not None and self._restarted(self.sample, sample):
            self._server_restarted(sample)
        self.bad_samples = self.bad_samples.good()
        previous = self.sample
        self.sample = sample
        self.sample_index += 1
        self.rates = self.window.push(sample)
        totals = sample.totals()
        self.history.append(QueuePoint(sample.time, totals.num_running, totals.num_waiting,
                                       totals.waiting_by_reason))
        pools = self.pools.views(self.sample_index, sample)
        self.stats = step_stats(self.sample_index, sample, previous, self.rates, pools)
        frame = self._publish(pools)
        if self.run_log is not None:
            self.run_log.record(frame, self.pools.journals())

    @staticmethod
    def _restarted(before: MetricsSample, after: MetricsSample) -> bool:
        """A new process start time, or counters both pages have that went backwards (a page lacking
        them is a bad sample, refused before it gets here)."""
        if None not in (before.process_start_time, after.process_start_time):
            return before.process_start_time != after.process_start_time
        old, new = before.totals(), after.totals()
        return new.prompt_tokens < old.prompt_tokens or new.generation_tokens < old.generation_tokens

    def _server_restarted(self, sample: MetricsSample) -> None:
        # Per engine, as the probe reads it (the totals add the ranks' pools up); sample_problem checked it.
        engine = sample.engines[0]
        if (engine.num_gpu_blocks, engine.block_size) != (self.server.num_gpu_blocks, self.server.block_size):
            self.server = dataclasses.replace(self.server, num_gpu_blocks=engine.num_gpu_blocks,
                                              block_size=engine.block_size)
            self.pools = PoolSet(self.server, self.preview_text)
        self.window.clear()
        self.notice("the server restarted: its pool was cleared here and rebuilt from what it replays")
        for index, stream in enumerate(self.streams):
            self.apply(index, stream.reset("the server restarted (its metrics started over)"))

    # --- events -------------------------------------------------------------------------------

    def apply(self, stream_index: int, items: list) -> None:
        if not items:
            return
        default_rank = self.server.event_sources[stream_index].rank or 0
        pools = self.pools
        for item in items:
            if type(item) is Delivery:
                rank = item.batch.data_parallel_rank
                pool = pools.pool(stream_index, default_rank if rank is None else rank)
                if pool is None:
                    self._refuse(stream_index, rank)
                    continue
                pool.apply(item.batch.events)
            else:
                pools.clear_stream(stream_index)
                self.notice(f"{item.reason}; the map was cleared")
        lost = sum(stream.num_lost for stream in self.streams)
        if lost > self._lost_batches:
            self.notice(f"{lost - self._lost_batches} event batches lost (gone from the server's replay "
                        "buffer); the map may lack some blocks until they are evicted")
            self._lost_batches = lost
        self._dirty = True

    def _refuse(self, stream_index: int, rank: int) -> None:
        key = (stream_index, rank)
        if key not in self._refused:
            if len(self._refused) < MAX_RANKS:
                self._refused.add(key)
            self.notice(f"batches of rank {rank} from {self.server.event_sources[stream_index].label} are not "
                        f"drawn: one more pool would pass kvscope's limits ({MAX_RANKS} pools, "
                        f"{MAX_BLOCKS:,} blocks)")

    def notice(self, text: str) -> None:
        self.notices.append(Notice(time.time(), text))
        self._dirty = True

    # --- frames -------------------------------------------------------------------------------

    def publish_if_due(self) -> None:
        """A frame, if events changed something and the frame budget allows one now."""
        if self._dirty and time.monotonic() >= self._next_frame:
            self._publish()

    def _publish(self, pools: tuple[PoolView, ...] | None = None) -> AttachFrame:
        started = time.thread_time()
        frame = self.make_frame(pools)
        self.publish(frame)
        cost = time.thread_time() - started
        self._next_frame = time.monotonic() + max(1 / FRAME_RATE, cost / FRAME_CPU_BUDGET)
        self._dirty = False
        return frame

    def make_frame(self, pools: tuple[PoolView, ...] | None = None) -> AttachFrame:
        self.frame_index += 1
        return AttachFrame(
            index=self.frame_index, time=time.time(), server=self.server, connection=self.connection,
            sample_index=self.sample_index, metrics=self.sample, rates=self.rates,
            queue_history=tuple(self.history), pools=pools or self.pools.views(self.sample_index, self.sample),
            streams=tuple(stream.status() for stream in self.streams), notices=tuple(self.notices),
            preview_note=self.preview_note, stats=self.stats,
            bad_samples=self.bad_samples)
