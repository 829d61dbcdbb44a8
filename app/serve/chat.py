"""/v1/chat/completions: the conversation through the model's chat template, the reply as a message.

The template is applied once per request, by the engine's tokenizer (LLMEngine.tokenize) on the way in, and
a reply without max_tokens gets what is left of the context and the pool after the prompt, as vLLM does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from kvscope.app.serve import protocol
from kvscope.app.serve.generation import EngineFacts, Job, StreamDelta
from kvscope.app.serve.logprobs import ChatLogprobs, PromptLogprob, chat_logprobs, prompt_logprobs
from kvscope.engine.outputs import RequestOutput, SampleOutput


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class _ChatChoice(protocol.Choice):
    logprobs: ChatLogprobs | None = None


class ChatChoice(_ChatChoice):
    message: ChatMessage


class ChatCompletion(protocol.Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None   # vLLM's, of the first prompt


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str


class DeltaChoice(_ChatChoice):
    delta: Delta


class ChatCompletionChunk(protocol.Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[DeltaChoice]


class ChatJob(Job):
    prompt_field = "messages"
    logprobs_field = "top_logprobs"
    id_prefix = "chatcmpl"
    response_type = ChatCompletion
    chunk_type = ChatCompletionChunk
    request: protocol.ChatCompletionRequest

    def make_prompts(self, facts: EngineFacts) -> list:
        return [self.request.chat(max_messages=facts.runner.max_model_len)]

    def max_tokens(self) -> int | None:
        return self.request.requested_max_tokens    # None: the engine gives what is left after the prompt

    def body(self, choices, usage: protocol.Usage) -> ChatCompletion:
        body = super().body(choices, usage)
        body.prompt_logprobs = prompt_logprobs(choices[0][2].prompt_logprobs, self.token_text) if choices else None
        return body

    def choice(self, index: int, sample: SampleOutput, output: RequestOutput) -> ChatChoice:
        return ChatChoice(index=index, message=ChatMessage(content=sample.text), finish_reason=sample.finish_reason,
                          logprobs=self._logprobs(sample.logprobs))

    def delta_choices(self, index: int, output: RequestOutput, new: StreamDelta) -> list[DeltaChoice]:
        deltas = [DeltaChoice(index=index, delta=Delta(role="assistant", content=""), finish_reason=None)] \
            if new.first else []
        if new.text is not None:
            deltas.append(DeltaChoice(index=index, delta=Delta(content=new.text), finish_reason=new.finish_reason,
                                      logprobs=self._logprobs(new.logprobs)))
        return deltas

    def _logprobs(self, entries) -> ChatLogprobs | None:
        return None if entries is None or not self.request.logprobs else chat_logprobs(entries, self.token_text)
