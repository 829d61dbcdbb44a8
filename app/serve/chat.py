"""/v1/chat/completions: the conversation through the model's chat template, the reply as a message.

The template is applied once per request, by the engine's tokenizer (LLMEngine.tokenize) on the way in, and
a reply without max_tokens gets what is left of the context and the pool after the prompt, as vLLM does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from kvscope.app.serve import protocol
from kvscope.app.serve.generation import EngineFacts, Job
from kvscope.engine.outputs import SampleOutput


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(protocol.Choice):
    message: ChatMessage


class ChatCompletion(protocol.Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str


class DeltaChoice(protocol.Choice):
    delta: Delta


class ChatCompletionChunk(protocol.Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[DeltaChoice]


class ChatJob(Job):
    prompt_field = "messages"
    id_prefix = "chatcmpl"
    request: protocol.ChatCompletionRequest

    def make_prompts(self, facts: EngineFacts) -> list:
        return [self.request.chat(max_messages=facts.runner.max_model_len)]

    def max_tokens(self) -> int | None:
        return self.request.requested_max_tokens    # None: the engine gives what is left after the prompt

    def body(self, choices: list[tuple[int, SampleOutput]], usage: protocol.Usage) -> ChatCompletion:
        return ChatCompletion(**self.envelope, usage=usage, choices=[
            ChatChoice(index=index, message=ChatMessage(content=sample.text), finish_reason=sample.finish_reason)
            for index, sample in choices])

    def chunks(self, index: int, first: bool, delta: str | None, finish: str | None) -> list[ChatCompletionChunk]:
        deltas = [DeltaChoice(index=index, delta=Delta(role="assistant", content=""), finish_reason=None)] \
            if first else []
        if delta is not None:
            deltas.append(DeltaChoice(index=index, delta=Delta(content=delta), finish_reason=finish))
        return [self._chunk([choice]) for choice in deltas]

    def usage_chunk(self, usage: protocol.Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(self, choices: list[DeltaChoice], usage: protocol.Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.envelope, choices=choices, usage=usage)
