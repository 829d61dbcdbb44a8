"""The engine thread runs at most MAX_STEPS_AHEAD_OF_UI steps ahead of the UI, and before it waits there it tells
the UI of every step it took: a UI can only hand back steps it was told of."""

from __future__ import annotations

import threading

from app_harness import FakeEngines
from test_app_worker import Inbox, start, stop

from kvscope.app.messages import EngineStepped, StepsReady
from kvscope.app.worker import step_posting
from kvscope.app.worker.commands import AddRequest
from kvscope.engine.config import SamplingParams

AHEAD = 8


class LateInbox(Inbox):
    """A UI that takes each batch of steps when it is posted, and hands them back only once let to."""

    def __init__(self) -> None:
        super().__init__()
        self.acking = False
        self.unacked = 0

    def post_message(self, message) -> bool:
        taken = message.batch.take() if isinstance(message, StepsReady) else [message]
        with self.changed:
            self.messages.extend(taken)
            self.unacked += len(taken) if isinstance(message, StepsReady) else 0
            self.changed.notify_all()
        if self.acking:
            self.ack_all()
        return True

    def ack_all(self) -> None:
        with self.changed:
            steps, self.unacked = self.unacked, 0
        self.worker.ack(steps)

    def steps(self) -> int:
        return len(self.of(EngineStepped))


def test_the_thread_posts_every_step_it_took_before_it_waits_for_the_ui(monkeypatch):
    # Batches are then posted only at once, never by the clock: the second batch starts within the interval
    # of the first post, so only the thread can post it.
    monkeypatch.setattr(step_posting, "STEPS_POST_INTERVAL", 3600.0)
    monkeypatch.setattr(step_posting, "MAX_STEPS_AHEAD_OF_UI", AHEAD)
    engines = FakeEngines()
    worker, inbox, thread = start(engines, LateInbox())
    worker.send(AddRequest("a", "hello there", SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)))

    inbox.wait_for(lambda: inbox.steps() == AHEAD)        # all it may run ahead, every one of them told
    assert len(engines.engine.stats) == AHEAD + 1         # and one more, held until the UI hands one back

    inbox.acking = True
    inbox.ack_all()
    inbox.wait_for(lambda: any(o.finished for m in inbox.of(EngineStepped) for o in m.result.outputs))
    stop(worker, thread)
    assert inbox.steps() == len(engines.engine.stats) == 60


def test_the_bound_holds_whatever_the_ui_hands_back():
    in_flight = step_posting.StepsInFlight(3)
    assert [in_flight.take() for _ in range(4)] == [True, True, True, False]
    in_flight.give_back(10)     # more than were taken: only those taken come back
    assert [in_flight.take() for _ in range(4)] == [True, True, True, False]
    assert not in_flight.wait(timeout=0.01)


def test_a_full_bound_waits_for_the_ui_on_another_thread():
    in_flight = step_posting.StepsInFlight(1)
    assert in_flight.take()
    handing_back = threading.Timer(0.05, in_flight.give_back, args=(1,))
    handing_back.start()
    assert in_flight.wait(timeout=30)   # woken by the give-back, and the place taken
    assert not in_flight.take()
    handing_back.join()
