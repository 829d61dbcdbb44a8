"""A chat turn from the window is tokenized once: the chat template runs once per turn, and the reply is sized by
the engine's one fit rule (LLMEngine.reply_room), not by a count of its own."""

from __future__ import annotations

import threading

from serve_helpers import count_template_calls, tiny_engine

from kvscope.app.messages import EngineReady, EngineStepped
from kvscope.app.worker.commands import AddChatTurn, Stop
from kvscope.app.worker.thread import EngineWorker
from kvscope.engine.config import EngineConfig, SamplingParams


class Inbox:
    def __init__(self) -> None:
        self.messages: list = []
        self.changed = threading.Condition()
        self.worker: EngineWorker | None = None

    def post_message(self, message) -> bool:
        with self.changed:
            self.messages.append(message)
            self.changed.notify_all()
        if isinstance(message, EngineStepped):
            self.worker.ack()
        return True

    def wait_for(self, condition) -> None:
        with self.changed:
            assert self.changed.wait_for(condition, 30), "the worker did not get there in time"


def run_turn(engine, max_tokens: int | None) -> list:
    inbox = Inbox()
    worker = EngineWorker(inbox, EngineConfig(num_blocks=96, max_model_len=256),
                          engine_factory=lambda config, previous=None: engine)
    inbox.worker = worker
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    inbox.wait_for(lambda: any(isinstance(m, EngineReady) for m in inbox.messages))
    messages = ({"role": "user", "content": "Hello there, how are you?"},)
    worker.send(AddChatTurn("chat-1", messages, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True)))
    inbox.wait_for(lambda: any(o.finished for m in inbox.messages if isinstance(m, EngineStepped)
                               for o in m.result.outputs))
    worker.send(Stop())
    thread.join(10)
    return [o for m in inbox.messages if isinstance(m, EngineStepped) for o in m.result.outputs if o.finished]


def test_a_chat_turn_applies_the_chat_template_once():
    engine = tiny_engine()
    calls = count_template_calls(engine)
    (final,) = run_turn(engine, max_tokens=4)
    assert calls == [1] and len(final.samples[0].token_ids) == 4


def test_a_chat_turn_longer_than_the_room_gets_what_is_left_after_its_prompt():
    engine = tiny_engine()
    (final,) = run_turn(engine, max_tokens=10_000)
    assert len(final.prompt_token_ids) + len(final.samples[0].token_ids) == engine.max_request_tokens(1) == 256
