"""/v1/completions: text (or token-id) prompts, several in one request if asked, the reply as text.

A reply without max_tokens is 16 tokens long, OpenAI's and vLLM's default for this endpoint.
"""

from __future__ import annotations

from typing import Literal

from kvscope.app.serve import protocol
from kvscope.app.serve.generation import EngineFacts, Job
from kvscope.engine.outputs import SampleOutput

DEFAULT_MAX_TOKENS = 16


class CompletionChoice(protocol.Choice):
    text: str


class Completion(protocol.Envelope):
    """The whole body, and each streamed chunk (whose usage is null unless it is the usage chunk)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionJob(Job):
    prompt_field = "prompt"
    id_prefix = "cmpl"
    request: protocol.CompletionRequest

    def make_prompts(self, facts: EngineFacts) -> list:
        return self.request.prompts()

    def max_tokens(self) -> int | None:
        asked = self.request.max_tokens
        return asked if asked is not None else DEFAULT_MAX_TOKENS

    def body(self, choices: list[tuple[int, SampleOutput]], usage: protocol.Usage) -> Completion:
        return self._completion([CompletionChoice(index=index, text=sample.text, finish_reason=sample.finish_reason)
                                 for index, sample in choices], usage)

    def chunks(self, index: int, first: bool, delta: str | None, finish: str | None) -> list[Completion]:
        if delta is None:
            return []
        return [self._completion([CompletionChoice(index=index, text=delta, finish_reason=finish)])]

    def usage_chunk(self, usage: protocol.Usage) -> Completion:
        return self._completion([], usage)

    def _completion(self, choices: list[CompletionChoice], usage: protocol.Usage | None = None) -> Completion:
        return Completion(**self.envelope, choices=choices, usage=usage)
