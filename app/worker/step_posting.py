"""How the engine thread hands its steps and messages to the UI (a mixin of EngineWorker).

Each step joins the batch of a StepsReady message the UI has not taken yet, or starts a batch that is posted
at most STEPS_POST_INTERVAL after the last one (at once before the thread waits for commands): every post wakes
the UI's loop, a system call and a thread switch, and a busy engine takes hundreds of steps a second. Any other
message posts the steps before it and closes their batch, so no step overtakes it. StepsInFlight bounds how far
the engine may run ahead of a UI that has stopped taking steps.

A post costs the engine thread what its target does with it: next to nothing in the window's process, but the
batch encoded and sent where the engine has a process of its own (app/worker/wire.py), which grows with the
batch's requests and its steps' block changes: 0.56 ms a post and 10 microseconds a step it carries at 256
requests on 330,000 blocks, 1.2 ms a post of sixty steps, 1.2% of the engine thread's time at ten a second. So
posts are spaced to keep their cost within POST_SHARE of the engine thread's time, as the window spaces its
costly frames (app/screens/main.py): no window costs the engine more than that share however big the engine, and
a bigger engine's window moves less often (nine times a second there, on a FakeRunner's 650 steps a second; a
model's slower steps make fewer steps a post, and posts cheaper). The cost is the median of the last RECENT_POSTS
posts', and a post that carried the pool's arrays whole (the first after a look between steps: 5 MB at that pool)
is left out, as its target says (``steps_sent_whole``): a one-off must not hold the window back.

Every step reaches the window with only the outputs it reads (``slimmed``): those of finished requests and of
the chat's turns (the only text the window streams); and without its KV-cache events, which only the engine's
observers read (the run log, kvscope serve's publisher), on the engine thread. Only the newest WHOLE_STEPS of a
batch keep their request views: the UI draws the newest, against the one before (the event line). An older step
is thinned as soon as a newer one joins (``thinned``): it keeps its block changes, stats and events, and drops
the request views. A busy engine makes hundreds of those objects a step; kept alive until the UI gets round to
the batch, they outlived the collector's young generations, which then walked them again and again on the engine
thread (a fifth of its time at 256 requests). A screen that takes every step whole (a lesson) sets
``whole_steps``.

With the window in another process (a target that encodes each batch as it is posted, app/worker/process.py),
posts are decided as steps join instead, so a step that no post will carry is thinned at once (_post_at_join),
and the target encodes it then (its ``thin_step``; ``restore_views`` gives the newest its views back).

The results the UI is handed are freed here, on the engine thread, as they are headless (``_free_taken``): a
whole step is thousands of objects (every request's output and view), and freeing them on the UI thread took
half a millisecond a step there, cache-cold, out of the budget the window paints with. The thread keeps a
reference to each step it posts and lets go of it once nobody else holds it. An engine process's target takes
its batches on this thread, so nothing needs keeping there.

How far the engine runs ahead of the UI is two counters (StepsInFlight), not a semaphore: the engine thread
takes a step's place with a comparison, and only a full window waits on a lock.
"""

from __future__ import annotations

import collections
import math
import statistics
import sys
import threading
import time

from kvscope.app.messages import EngineStepped, StepBatch, StepsReady
from kvscope.engine.outputs import StepResult

# Steps the engine may run ahead of a UI that has stopped taking them. Posts come up to MAX_POST_INTERVAL apart
# and a busy engine's carry a hundred steps and more, which the window acknowledges in bulk, half this many at a
# time (app/worker/process.py): at 256, an engine of 256 requests on 330,000 blocks reached the bound every five
# posts and waited for the window. A thinned step held here is a few kilobytes.
MAX_STEPS_AHEAD_OF_UI = 512
# Seconds: a busy engine tells the UI of new steps at most this often, so the live window moves at up to ten
# frames a second while the engine runs (as `kvscope attach` draws a vLLM server). Each post costs the engine a
# fixed amount (the newest step's views encoded, the window woken, the caches it leaves cold): at twenty a
# second the window cost the engine process 7.2% of its steps, at ten 5.7% (`bench ui`, medians of five runs
# each, alternated). With the older steps thinned, a longer batch costs no more to keep.
STEPS_POST_INTERVAL = 1 / 10
# The share of the engine thread's time its posts may take (see the module's doc), and the longest wait between
# two posts however costly they are: the window is never staler than that.
POST_SHARE = 0.01
MAX_POST_INTERVAL = 1 / 2
RECENT_POSTS = 5
WHOLE_STEPS = 2
# Steps kept for freeing here (``_free_taken``) at most: past that, the oldest is let go of, and whoever holds it
# last frees it (a UI that keeps many steps: a lesson's).
MAX_STEPS_TO_FREE = 64


def slimmed(result: StepResult, watched) -> StepResult:
    """``result`` with only the outputs of finished requests and of ``watched`` ones, and no KV-cache events."""
    outputs = result.outputs
    if watched:
        kept = [output for output in outputs if output.finished or output.request_id in watched]
    else:
        kept = result.finished_outputs
    if len(kept) == len(outputs) and not result.kv_events:
        return result
    return StepResult(kept, result.stats, result.snapshot, result.events)


def thinned(result: StepResult, watched) -> StepResult:
    """``result`` as a step the UI will not draw: its block arrays without the request views, and only the
    outputs of finished requests and of ``watched`` ones."""
    return StepResult(slimmed(result, watched).outputs, result.stats, result.snapshot.without_requests(),
                      result.events)


def _references(result) -> int:
    """The references to ``result`` as sys.getrefcount counts them from here: compared with ALONE, what the same
    count finds for an object only a list holds, so the call's own (the loop's, the argument's, getrefcount's)
    cancel out. A snapshot someone else still holds (the window's map draws one) is freed by them."""
    return sys.getrefcount(result)


def _alone_count() -> int:
    probe = StepResult([], None, None)
    held = [probe]
    del probe     # only the list holds it now, as the list of results to free holds a result
    for result in held:
        return _references(result)
    raise AssertionError("unreachable")


ALONE = _alone_count()


class StepsInFlight:
    """The steps posted and not yet handed back by the UI, at most ``bound``. ``take`` is for the engine thread
    only; ``give_back`` for any. A BoundedSemaphore took and let go of its lock on every step, a few microseconds
    of the engine thread each time."""

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._taken = 0         # written by the engine thread only
        self._given_back = 0    # written under the lock
        self._changed = threading.Condition()

    def take(self) -> bool:
        """Take a place for one more step; False when all ``bound`` are taken."""
        if self._taken - self._given_back >= self._bound:
            return False
        self._taken += 1
        return True

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a place, and take it; False if none came."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._taken - self._given_back < self._bound, timeout):
                return False
        return self.take()

    def give_back(self, steps: int) -> None:
        """The UI handled ``steps`` more steps. More than were taken (a UI that counts a batch twice) gives back
        only those taken: the bound must hold whatever the UI says."""
        with self._changed:
            self._given_back = min(self._given_back + steps, self._taken)
            self._changed.notify()


class StepPosting:
    """Needs ``self.target`` (what messages are posted to) and ``self._stopping`` (a threading.Event)."""

    def __init__(self) -> None:
        self._in_flight = StepsInFlight(MAX_STEPS_AHEAD_OF_UI)
        self._batch: StepBatch | None = None    # the newest steps, while the UI has not taken them
        self._batch_posted = False
        self._steps_posted_at = 0.0
        self._post_interval = STEPS_POST_INTERVAL    # as the recent posts' cost allows (see the module's doc)
        self._post_costs: collections.deque[float] = collections.deque(maxlen=RECENT_POSTS)
        self.whole_steps = False    # set by the UI while a screen takes every step whole
        # Requests whose every output the UI shows (the chat's turns), and the step count up to which it needs
        # them: a finished one's earlier steps may still be thinned until WHOLE_STEPS newer steps have joined.
        self._watched: dict[str, float] = {}
        self._to_free: list = []    # the results posted, until only this list holds them (see the module's doc)
        # The window in a process of its own (app/worker/process.py): its target encodes a batch the moment it is
        # posted, so posts are decided as steps join, and only the steps a post will carry keep their views.
        self._posts_at_join = getattr(self.target, "ENCODES_WHEN_POSTED", False)
        self._post_next = False     # the next step to join is posted with this one, both whole
        self._joined_at = 0.0
        self._newest_engine = None  # the engine of the newest step not yet posted, to see its views again

    def ack(self, steps: int = 1) -> None:
        """The UI handled ``steps`` steps (the EngineStepped of a StepsReady): one call for a whole batch."""
        if steps >= 1:
            self._in_flight.give_back(steps)

    def _watch(self, request_id: str) -> None:
        self._watched[request_id] = math.inf

    def _unwatch_finished(self, finished: list, steps_done: int) -> None:
        """Called with each step's finished outputs before it is posted: their requests stop being watched once
        every step of theirs that may be thinned has been."""
        watched = self._watched
        if not watched:
            return
        for output in finished:
            if output.request_id in watched:
                watched[output.request_id] = steps_done + WHOLE_STEPS
        for request_id in [rid for rid, until in watched.items() if until < steps_done]:
            del watched[request_id]

    def _free_taken(self) -> None:
        """Let go of the posted results nobody else holds any more, so that they are freed on this thread. Only
        this list can hand such a result on, so no other thread can take it back between the look and the drop."""
        kept = [result for result in self._to_free if _references(result) > ALONE]
        if len(kept) > MAX_STEPS_TO_FREE:
            del kept[0]
        self._to_free = kept

    def _post_step(self, result, engine) -> None:
        """Hand ``result``, a step ``engine`` just took, to the UI's next batch."""
        if not self._in_flight.take():
            # The UI can only hand back steps it has been told of: a batch begun within the post interval of
            # the last post waits for the thread's next turn to be posted, and a fast engine can fill the bound
            # before that turn comes. Waiting here without posting it waited for ever.
            self._tell_steps()
            while not self._in_flight.wait(timeout=0.1):
                if self._stopping.is_set():
                    return
        if not self.whole_steps:
            result = slimmed(result, self._watched)
        if self._posts_at_join:
            self._newest_engine = engine
        else:
            self._to_free.append(result)
        stepped = EngineStepped(result)
        if self._batch is None or not self._batch.add(stepped):
            self._batch, self._batch_posted = StepBatch(), False
            self._batch.add(stepped)
            if not self._posts_at_join:
                self._tell_steps(now=False)
        if self._posts_at_join and not self.whole_steps:
            self._post_at_join(result)
        elif not self.whole_steps:
            self._batch.thin(WHOLE_STEPS, self._thinned)
        if not self._posts_at_join:
            # After the thinning, so the step it thinned is freed now, while still in the cache; and with this
            # frame's own references dropped, for that step may be this one.
            result = stepped = None
            self._free_taken()

    def _thinned(self, result):
        """``result`` thinned; where the target encodes what it is posted (an engine process), already encoded,
        while the step's objects are still in the cache (app/worker/wire.py)."""
        if self._posts_at_join:
            return self.target.thin_step(slimmed(result, self._watched))
        return thinned(result, self._watched)

    def _post_at_join(self, newest: StepResult) -> None:
        """The engine process's rule: a post every post interval, made as its newest step joins, so the
        views of no other step are kept while the engine takes its next one. Holding one step's results through
        the next made that next step 15% slower (256 requests, 330,000 blocks, thread CPU): they hold the block
        tables it replaces, which are then freed later, out of the cache. The step before a post's newest keeps
        its views (the event line reads it) when the post was foreseen."""
        clock = time.monotonic()
        due_at = self._steps_posted_at + self._post_interval
        if self._post_next or clock >= due_at:
            # The event line reads the step before only for a step that computed prompt tokens (whose chunks
            # it counts and whose newcomers it names): otherwise that step's views are not sent.
            self._batch.thin(WHOLE_STEPS if newest.stats.num_prefill_tokens else 1, self._thinned)
            self._tell_steps()
            self._post_next = False
        else:
            # The next step is posted if it will end after the post is due, steps taking as long as the last.
            self._post_next = 2 * clock - self._joined_at >= due_at
            self._batch.thin(1 if self._post_next else 0, self._thinned)
        self._joined_at = clock

    def _tell_steps(self, now: bool = True) -> None:
        """Post the batch of steps nobody was told of yet; unless ``now``, only once the post interval has
        passed since the last (each post wakes the UI's loop: a system call and a thread switch), and never
        where posts are made as steps join (_post_at_join). The post's cost sets the next interval."""
        if self._batch is None or self._batch_posted:
            return
        clock = time.monotonic()
        if not now and (self._posts_at_join or clock - self._steps_posted_at < self._post_interval):
            return
        if self._posts_at_join:
            self._restore_newest()
        self._batch_posted, self._steps_posted_at = True, clock
        cpu = time.thread_time()
        self.target.post_message(StepsReady(self._batch))
        self._pace(time.thread_time() - cpu)

    def _pace(self, cost: float) -> None:
        """Space the next post by what posts cost (see the module's doc): ``cost`` is this one's."""
        if not getattr(self.target, "steps_sent_whole", False):
            self._post_costs.append(cost)
        usual = statistics.median(self._post_costs) if self._post_costs else 0.0
        self._post_interval = max(STEPS_POST_INTERVAL, min(MAX_POST_INTERVAL, usual / POST_SHARE))

    def _restore_newest(self) -> None:
        """A post the engine process did not foresee (the engine pauses, goes idle, another message follows):
        its newest step gets the views its engine shows now, between steps, which are that step's unless a
        command changed the queues since."""
        engine, self._newest_engine = self._newest_engine, None    # a retired engine is not kept alive for it
        if engine is not None:
            self._batch.restore_newest(lambda step: self.target.restore_views(step, engine.snapshot()))

    def _post(self, message) -> None:
        """Post any message but a step: the steps before it reach the UI before it."""
        self._tell_steps()
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        self.target.post_message(message)

