"""EngineObserver: what LLMEngine tells the objects in its ``observers`` list, written as a Protocol.

A run log (app.runlog.record_run) is one; anything with these two methods can be. The engine calls them
inside its lock, on the thread that added the request or ran the step, so an observer should be quick
(queue the record rather than write it) and must not call step(). One that raises is removed with a
RuntimeWarning, and the engine goes on serving.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvscope.engine.outputs import StepResult


@runtime_checkable
class EngineObserver(Protocol):
    def request_added(self, request_id: str, prompt_text: str, num_prompt_tokens: int, n: int) -> None:
        """A request was accepted: ``prompt_text`` is the prompt as text (chat messages one per line)."""
        ...

    def step(self, result: StepResult) -> None:
        """A step finished; ``result`` is what step() returns."""
        ...
