"""Steps that wait for the UI behind newer ones come thinned: the window draws only the newest (against the one
before), keeps every step's block changes, stats and finished requests, and streams only the chat's text."""

from __future__ import annotations

import threading
import weakref

from serve_helpers import tiny_engine

from kvscope.app.messages import EngineReady, RunUntilDone, StepsReady
from kvscope.app.worker.commands import AddChatTurn, AddRequest, RunUntil, Stop
from kvscope.app.worker.step_posting import WHOLE_STEPS
from kvscope.app.worker.thread import EngineWorker
from kvscope.engine.config import SamplingParams


class LateInbox:
    """A UI that takes no step until the run is over, so every step waits behind the newer ones."""

    def __init__(self) -> None:
        self.messages: list = []
        self.changed = threading.Condition()

    def post_message(self, message) -> bool:
        with self.changed:
            self.messages.append(message)
            self.changed.notify_all()
        return True

    def wait_for(self, kind) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: any(isinstance(m, kind) for m in self.messages), 60)


def run_busy(whole_steps: bool) -> list[list]:
    """A chat turn and a longer request for 30 steps; the steps of each StepsReady, as the worker left them."""
    engine = tiny_engine()
    inbox = LateInbox()
    worker = EngineWorker(inbox, engine.config, engine_factory=lambda config, previous=None: engine)
    worker.whole_steps = whole_steps
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    inbox.wait_for(EngineReady)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    worker.send(AddRequest("load", [5, 6, 7, 8], SamplingParams(max_tokens=60, **greedy)))
    worker.send(AddChatTurn("chat", ({"role": "user", "content": "Hello there"},),
                            SamplingParams(max_tokens=12, **greedy)))
    worker.send(AddRequest("short", [9, 10], SamplingParams(max_tokens=3, **greedy)))
    worker.send(RunUntil(lambda result: False, 30))
    inbox.wait_for(RunUntilDone)
    worker.send(Stop())
    thread.join(10)
    assert not thread.is_alive()
    return [m.batch.take() for m in inbox.messages if isinstance(m, StepsReady)]


def test_steps_behind_the_newest_two_keep_their_blocks_and_finished_requests_and_the_chat_every_output():
    """Every step comes with only the outputs the window reads (finished requests, the chat's turn); the newest
    two of a batch keep their request views, the older ones their block changes only."""
    batches = run_busy(whole_steps=False)
    assert max(len(steps) for steps in batches) > WHOLE_STEPS + 5
    finished = set()
    for steps in batches:
        for index, stepped in enumerate(steps):
            result = stepped.result
            ids = {output.request_id for output in result.outputs}
            finished |= {output.request_id for output in result.outputs if output.finished}
            assert result.snapshot.blocks is not None and result.stats.step == result.snapshot.step
            assert ids <= {"chat"} | {o.request_id for o in result.outputs if o.finished}
            if index >= len(steps) - WHOLE_STEPS:
                # "load" is live in them, or ends there (the Stop aborts it: its final output)
                assert "load" in {v.request_id for v in result.snapshot.requests} | ids
            else:
                assert result.snapshot.requests == ()
    assert finished == {"chat", "short", "load"}     # "load" aborted by the Stop
    chat = [o for steps in batches for s in steps for o in s.result.outputs if o.request_id == "chat"]
    assert chat[-1].finished and len(chat) == 12
    assert "".join(output.text_delta for output in chat) == chat[-1].text


def test_a_screen_that_takes_every_step_whole_gets_every_output_and_request_view():
    batches = run_busy(whole_steps=True)
    steps = [s.result for batch in batches for s in batch]
    assert len(steps) >= 30
    for result in steps:
        running = {v.request_id for v in result.snapshot.requests if v.queue == "running"}
        assert running <= {o.request_id for o in result.outputs}


class TakingInbox(LateInbox):
    """A UI on a thread of its own that takes each batch as it comes and keeps the newest two steps, as the window
    does (its latest and previous), noting on which thread each whole step it let go of was freed."""

    def __init__(self, worker_of) -> None:
        super().__init__()
        self._worker_of = worker_of
        self.freed_on: list[int] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._take, daemon=True)

    def _take(self) -> None:
        kept: list = []
        taken = 0
        while not self.done.is_set() or taken < len(self.messages):
            with self.changed:
                self.changed.wait_for(lambda seen=taken: seen < len(self.messages) or self.done.is_set(), 0.05)
                new, taken = self.messages[taken:], len(self.messages)
            for message in new:
                if not isinstance(message, StepsReady):
                    continue
                for stepped in message.batch.take():
                    self._worker_of().ack()
                    if stepped.result.snapshot.requests:     # a whole step
                        weakref.finalize(stepped.result, lambda: self.freed_on.append(threading.get_ident()))
                    kept = [*kept[-1:], stepped.result]
                    del stepped


def test_the_steps_the_ui_lets_go_of_are_freed_on_the_engine_thread():
    """Freeing a whole step (every request's output and view) cost the UI thread half a millisecond a step,
    cache-cold, out of the budget it paints with; headless, the engine thread frees them."""
    engine = tiny_engine()
    workers: list = []
    inbox = TakingInbox(lambda: workers[0])
    worker = EngineWorker(inbox, engine.config, engine_factory=lambda config, previous=None: engine)
    workers.append(worker)
    inbox.thread.start()
    thread = threading.Thread(target=worker.run, daemon=True, name="engine")
    thread.start()
    inbox.wait_for(EngineReady)
    worker.send(AddRequest("load", [5, 6, 7, 8], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)))
    worker.send(RunUntil(lambda result: False, 150))
    inbox.wait_for(RunUntilDone)
    worker.send(Stop())
    thread.join(10)
    inbox.done.set()
    inbox.thread.join(10)
    # Only the last steps the UI kept, let go of after the engine thread stopped, may be freed on the UI's.
    on_engine = [index for index, ident in enumerate(inbox.freed_on) if ident == thread.ident]
    assert len(on_engine) >= 3
    assert set(inbox.freed_on[:on_engine[-1]]) == {thread.ident}
