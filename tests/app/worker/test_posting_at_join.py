"""The engine process's posting rule (app/worker/step_posting.py, _post_at_join): a post is decided as its newest
step joins and encoded at once, so only the steps a post carries whole keep their views; every post's newest step
still reaches the window whole, however the post came about (due, foreseen, or forced by a pause), and what
crosses the pipe is the engine's own steps."""

from __future__ import annotations

import gc
import statistics
import threading
import weakref

from serve_helpers import tiny_engine

from kvscope.app.messages import EngineReady, RunStateChanged, RunUntilDone, StepsReady
from kvscope.app.worker import step_posting
from kvscope.app.worker.commands import AddRequest, Rebuild, RunUntil, SetPaused, Stop
from kvscope.app.worker.thread import EngineWorker
from kvscope.app.worker.wire import MessageDecoder, MessageEncoder
from kvscope.engine.config import SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}


class PipeInbox:
    """What the engine process's pipe does with each message: encoded when posted, decoded on the far side, its
    steps acknowledged at once (as a window that keeps up)."""

    ENCODES_WHEN_POSTED = True

    def __init__(self) -> None:
        self.encoder, self.decoder = MessageEncoder(), MessageDecoder()
        self.messages: list = []
        self.worker = None
        self.changed = threading.Condition()
        self.costing = lambda: None     # called as each message is posted (StepClock.spend)
        self.steps_sent_whole = False   # as the engine process's target says (app/worker/process.py)

    def thin_step(self, result):
        return self.encoder.thin_step(result)

    def restore_views(self, step, snapshot):
        return self.encoder.restore_views(step, snapshot)

    def post_message(self, message) -> bool:
        encoded = self.encoder.encode(message)
        if isinstance(message, StepsReady):
            self.steps_sent_whole = self.encoder.sent_whole
        self.costing()
        decoded = self.decoder.decode(encoded)
        if isinstance(decoded, StepsReady):
            decoded = decoded.batch.take()
            self.worker.ack(len(decoded))
        with self.changed:
            self.messages.append(decoded)
            self.changed.notify_all()
        return True

    def wait_for(self, test) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: any(test(m) for m in self.messages), 60)

    @property
    def posts(self) -> list[list]:
        return [[stepped.result for stepped in m] for m in self.messages if isinstance(m, list)]


def start(**config) -> tuple[EngineWorker, PipeInbox, threading.Thread, object]:
    engine = tiny_engine(**config)
    inbox = PipeInbox()
    worker = EngineWorker(inbox, engine.config, engine_factory=lambda config, previous=None: engine)
    inbox.worker = worker
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    inbox.wait_for(lambda m: isinstance(m, EngineReady))
    return worker, inbox, thread, engine


def has_views(result) -> bool:
    stats = result.stats
    return bool(result.snapshot.requests) or not (stats.num_running or stats.num_waiting or stats.num_swapped)


class StepClock:
    """time.monotonic for step_posting: 7 ms a reading, so posts come every few steps whatever the machine; and
    the engine thread's CPU, which only ``spend`` moves (posts cost nothing unless a test says so)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cpu = 0.0

    def monotonic(self) -> float:
        self.now += 0.007
        return self.now

    def thread_time(self) -> float:
        return self.cpu

    def spend(self, seconds: float) -> None:
        self.cpu += seconds


def test_each_post_carries_its_newest_step_whole_and_no_other_but_the_one_an_event_line_reads(monkeypatch):
    monkeypatch.setattr(step_posting, "time", StepClock())
    worker, inbox, thread, _ = start(max_num_batched_tokens=16)
    for index in range(6):     # prompts longer than a step's budget: chunked prefills among the decodes
        worker.send(AddRequest(f"r{index}", list(range(5, 100 + 20 * index)), SamplingParams(max_tokens=60, **GREEDY)))
    worker.send(RunUntil(lambda result: False, 120))
    inbox.wait_for(lambda m: isinstance(m, RunUntilDone))
    worker.send(Stop())
    thread.join(10)
    posts = inbox.posts
    steps = [result.stats.step for post in posts for result in post]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 60
    assert max(len(post) for post in posts) > 3, "posts come every STEPS_POST_INTERVAL, not every step"
    for post in posts:
        *older, newest = post
        assert has_views(newest)
        for index, result in enumerate(older):
            before_newest = index == len(older) - 1
            if result.snapshot.requests:
                assert before_newest and newest.stats.num_prefill_tokens, "views sent that no one reads"
    prefilling = [post for post in posts if len(post) > 1 and post[-1].stats.num_prefill_tokens]
    assert prefilling and any(post[-2].snapshot.requests for post in prefilling)


def posted(monkeypatch, post_cost: float, only_whole: bool = False) -> list[int]:
    """The steps of each post, each post costing ``post_cost`` of the engine thread's CPU (``only_whole``: only
    those that carried the pool's arrays whole)."""
    clock = StepClock()
    monkeypatch.setattr(step_posting, "time", clock)
    worker, inbox, thread, _ = start()
    inbox.costing = lambda: clock.spend(post_cost if inbox.steps_sent_whole or not only_whole else 0.0)
    for index in range(4):
        worker.send(AddRequest(f"r{index}", [5, 6, 7, 8 + index], SamplingParams(max_tokens=200, **GREEDY)))
    worker.send(RunUntil(lambda result: False, 160))
    inbox.wait_for(lambda m: isinstance(m, RunUntilDone))
    worker.send(Stop())
    thread.join(10)
    return [len(post) for post in inbox.posts]


def steps_per_post(monkeypatch, post_cost: float) -> float:
    return statistics.median(posted(monkeypatch, post_cost))    # not the first (before any cost) or the last


def test_costly_posts_come_further_apart_so_posting_keeps_within_its_share(monkeypatch):
    cheap = steps_per_post(monkeypatch, 0.0)
    # A post that costs the engine thread 4 ms may come every 0.4 s (POST_SHARE), four times the interval of a
    # cheap one; one of 20 ms every MAX_POST_INTERVAL, not every 2 s.
    costly = steps_per_post(monkeypatch, 0.4 * step_posting.POST_SHARE)
    dear = steps_per_post(monkeypatch, 2.0 * step_posting.POST_SHARE)
    assert 3 * cheap <= costly <= 5 * cheap
    assert 4 * cheap <= dear <= 6 * cheap, "posts come at least every MAX_POST_INTERVAL"


def test_a_post_that_carried_the_pool_whole_does_not_space_the_next(monkeypatch):
    """The first post of an engine carries its arrays whole (and so does the first after a look between steps):
    however dear, the posts after it come as often as their own cost allows."""
    cheap = steps_per_post(monkeypatch, 0.0)
    sizes = posted(monkeypatch, 2.0 * step_posting.POST_SHARE, only_whole=True)
    assert sizes[1] <= cheap + 1, sizes


def test_a_post_the_engine_did_not_foresee_still_shows_the_newest_steps_requests():
    """Pausing mid-run posts the steps so far at once, their newest thinned as it joined: it gets the views its
    engine shows after it, which the window then keeps on screen while paused."""
    worker, inbox, thread, engine = start()
    for index in range(3):
        worker.send(AddRequest(f"r{index}", [5, 6, 7, 8 + index], SamplingParams(max_tokens=240, **GREEDY)))
    inbox.wait_for(lambda m: isinstance(m, list) and m and m[-1].result.stats.step > 20)
    worker.send(SetPaused(True))
    inbox.wait_for(lambda m: isinstance(m, RunStateChanged) and m.state.paused)
    paused_at = next(i for i, m in enumerate(inbox.messages) if isinstance(m, RunStateChanged) and m.state.paused)
    last = [m for m in inbox.messages[:paused_at] if isinstance(m, list)][-1][-1].result
    assert last.stats.step == engine.step_counter
    assert {v.request_id for v in last.snapshot.requests} == {"r0", "r1", "r2"}
    assert last.snapshot.requests == engine.snapshot().requests
    worker.send(Stop())
    thread.join(10)


def test_a_replaced_engine_is_let_go_of_once_its_last_step_is_posted():
    """The worker keeps the newest step's engine only until that step is posted (to show its views again): a
    retired engine, and its model, must not live on behind a paused window."""
    engines = []

    def build(config, previous=None):
        engines.append(tiny_engine())
        return engines[-1]

    inbox = PipeInbox()
    worker = EngineWorker(inbox, tiny_engine().config, engine_factory=build)
    inbox.worker = worker
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    inbox.wait_for(lambda m: isinstance(m, EngineReady))
    worker.send(AddRequest("r0", [5, 6, 7, 8], SamplingParams(max_tokens=200, **GREEDY)))
    inbox.wait_for(lambda m: isinstance(m, list) and m and m[-1].result.stats.step > 5)
    first = weakref.ref(engines[0])
    worker.send(SetPaused(True))
    worker.send(Rebuild(engines[0].config))
    inbox.wait_for(lambda m: isinstance(m, EngineReady) and len(engines) == 2)
    worker.send(Stop())
    thread.join(10)
    engines.pop(0)
    gc.collect()
    assert first() is None
