"""How the engine thread hands its steps and messages to the UI (a mixin of EngineWorker).

Each step joins the batch of a StepsReady message the UI has not taken yet, or starts a batch that is posted
at most STEPS_POST_INTERVAL after the last one (at once before the thread waits for commands): every post wakes
the UI's loop, a system call and a thread switch, and a busy engine takes hundreds of steps a second. Any other
message posts the steps before it and closes their batch, so no step overtakes it. A semaphore bounds how far
the engine may run ahead of a UI that has stopped taking steps.

Every step reaches the window with only the outputs it reads (``slimmed``): those of finished requests and of
the chat's turns (the only text the window streams). Only the newest WHOLE_STEPS of a batch keep their request
views: the UI draws the newest, against the one before (the event line). An older step is thinned as soon as a
newer one joins (``thinned``): it keeps its block changes, stats and events, and drops the request views. A
busy engine makes hundreds of those objects a step; kept alive until the UI gets round to the batch, they
outlived the collector's young generations, which then walked them again and again on the engine thread (a
fifth of its time at 256 requests). A screen that takes every step whole (a lesson) sets ``whole_steps``.

The results the UI is handed are freed here, on the engine thread, as they are headless (``_free_taken``): a
whole step is thousands of objects (every request's output and view), and freeing them on the UI thread took
half a millisecond a step there, cache-cold, out of the budget the window paints with. The thread keeps a
reference to each step it posts and lets go of it once nobody else holds it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time

from kvscope.app.messages import EngineStepped, StepBatch, StepsReady
from kvscope.engine.outputs import CacheSnapshot, StepResult

MAX_STEPS_AHEAD_OF_UI = 256
STEPS_POST_INTERVAL = 1 / 20    # seconds: a busy engine tells the UI of new steps at most this often (as often
# as the window draws at most; with the older steps thinned, a longer batch costs no more to keep)
WHOLE_STEPS = 2
# Steps kept for freeing here (``_free_taken``) at most: past that, the oldest is let go of, and whoever holds it
# last frees it (a UI that keeps many steps: a lesson's).
MAX_STEPS_TO_FREE = 64


def slimmed(result: StepResult, watched) -> StepResult:
    """``result`` with only the outputs of finished requests and of ``watched`` ones."""
    outputs = result.outputs
    kept = [output for output in outputs if output.finished or output.request_id in watched]
    return result if len(kept) == len(outputs) else dataclasses.replace(result, outputs=kept)


def thinned(result: StepResult, watched) -> StepResult:
    """``result`` as a step the UI will not draw: its block arrays without the request views, and only the
    outputs of finished requests and of ``watched`` ones."""
    snapshot = result.snapshot
    bare = CacheSnapshot(snapshot.step, snapshot.block_size, snapshot.num_blocks, snapshot.allocator,
                         blocks=snapshot.blocks, num_host_blocks=snapshot.num_host_blocks,
                         num_free_host_blocks=snapshot.num_free_host_blocks,
                         kv_cache_groups=snapshot.kv_cache_groups)
    return dataclasses.replace(slimmed(result, watched), snapshot=bare)


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


class StepPosting:
    """Needs ``self.target`` (what messages are posted to) and ``self._stopping`` (a threading.Event)."""

    def __init__(self) -> None:
        self._in_flight = threading.BoundedSemaphore(MAX_STEPS_AHEAD_OF_UI)
        self._batch: StepBatch | None = None    # the newest steps, while the UI has not taken them
        self._batch_posted = False
        self._steps_posted_at = 0.0
        self.whole_steps = False    # set by the UI while a screen takes every step whole
        # Requests whose every output the UI shows (the chat's turns), and the step count up to which it needs
        # them: a finished one's earlier steps may still be thinned until WHOLE_STEPS newer steps have joined.
        self._watched: dict[str, float] = {}
        self._to_free: list = []    # the results posted, until only this list holds them (see the module's doc)

    def ack(self, steps: int = 1) -> None:
        """The UI handled ``steps`` steps (the EngineStepped of a StepsReady): one release for a whole batch."""
        if steps < 1:
            return
        try:
            self._in_flight.release(steps)
        except ValueError:    # more than were taken (a bounded semaphore releases none then): as many as fit
            for _ in range(steps):
                try:
                    self._in_flight.release()
                except ValueError:
                    return

    def _watch(self, request_id: str) -> None:
        self._watched[request_id] = math.inf

    def _unwatch_finished(self, result, steps_done: int) -> None:
        """Called with each step before it is posted: its finished requests stop being watched once every step
        of theirs that may be thinned has been."""
        watched = self._watched
        if not watched:
            return
        for output in result.outputs:
            if output.finished and output.request_id in watched:
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

    def _post_step(self, result) -> None:
        if not self._in_flight.acquire(blocking=False):
            # The UI can only hand back steps it has been told of: a batch begun within STEPS_POST_INTERVAL of
            # the last post waits for the thread's next turn to be posted, and a fast engine can fill the bound
            # before that turn comes. Waiting here without posting it waited for ever.
            self._tell_steps()
            while not self._in_flight.acquire(timeout=0.1):
                if self._stopping.is_set():
                    return
        if not self.whole_steps:
            result = slimmed(result, self._watched)
        self._to_free.append(result)
        stepped = EngineStepped(result)
        if self._batch is not None and self._batch.add(stepped):
            if not self.whole_steps:
                self._batch.thin(WHOLE_STEPS, lambda older: thinned(older, self._watched))
        else:
            self._batch, self._batch_posted = StepBatch(), False
            self._batch.add(stepped)
            self._tell_steps(now=False)
        self._free_taken()    # after the thinning, so the step it thinned is freed now, while still in the cache

    def _tell_steps(self, now: bool = True) -> None:
        """Post the batch of steps nobody was told of yet; unless ``now``, only once STEPS_POST_INTERVAL has
        passed since the last (each post wakes the UI's loop: a system call and a thread switch)."""
        if self._batch is None or self._batch_posted:
            return
        clock = time.monotonic()
        if not now and clock - self._steps_posted_at < STEPS_POST_INTERVAL:
            return
        self._batch_posted, self._steps_posted_at = True, clock
        self.target.post_message(StepsReady(self._batch))

    def _post(self, message) -> None:
        """Post any message but a step: the steps before it reach the UI before it."""
        self._tell_steps()
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        self.target.post_message(message)

