"""How the engine thread hands its steps and messages to the UI (a mixin of EngineWorker).

Each step joins the batch of a StepsReady message the UI has not taken yet, or starts a batch that is posted
at most STEPS_POST_INTERVAL after the last one (at once before the thread waits for commands): every post wakes
the UI's loop, a system call and a thread switch, and a busy engine takes hundreds of steps a second. Any other
message posts the steps before it and closes their batch, so no step overtakes it. A semaphore bounds how far
the engine may run ahead of a UI that has stopped taking steps.
"""

from __future__ import annotations

import threading
import time

from kvscope.app.messages import EngineStepped, StepBatch, StepsReady

MAX_STEPS_AHEAD_OF_UI = 256
STEPS_POST_INTERVAL = 1 / 50    # seconds: a busy engine tells the UI of new steps at most this often


class StepPosting:
    """Needs ``self.target`` (what messages are posted to) and ``self._stopping`` (a threading.Event)."""

    def __init__(self) -> None:
        self._in_flight = threading.BoundedSemaphore(MAX_STEPS_AHEAD_OF_UI)
        self._batch: StepBatch | None = None    # the newest steps, while the UI has not taken them
        self._batch_posted = False
        self._steps_posted_at = 0.0

    def ack(self) -> None:
        """The UI handled one step (an EngineStepped of a StepsReady)."""
        try:
            self._in_flight.release()
        except ValueError:
            pass

    def _post_step(self, result) -> None:
        while not self._in_flight.acquire(timeout=0.1):
            if self._stopping.is_set():
                return
        stepped = EngineStepped(result)
        if self._batch is not None and self._batch.add(stepped):
            return    # joins the steps the UI has not taken yet
        self._batch, self._batch_posted = StepBatch(), False
        self._batch.add(stepped)
        self._tell_steps(now=False)

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

