"""The OpenAI request bodies kvscope accepts, checked by pydantic, and the response bodies it sends.

Field names and defaults are OpenAI's and vLLM's (vLLM's extensions: top_k, ignore_eos, stop_token_ids).
Models are strict (a string is not a number) and forbid fields they do not name, so a typo or a parameter
nobody implements is refused by name instead of ignored. Parameters kvscope cannot honour are accepted only
at the value that changes nothing (``logprobs: null``, ``presence_penalty: 0``, ``repetition_penalty: 1``, as
vLLM's own benchmark client sends them); any other value is refused with the reason.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvscope.app.serve.errors import APIError, bad_request

MAX_N = 32              # samples per prompt; the engine also checks that they fit the pool
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64        # prompts in one batched /v1/completions request
MAX_INT = 2**31 - 1     # the largest count or seed taken: a 4,000-digit number is refused, not carried along

# name -> (values that change nothing, why kvscope cannot do anything else)
NEUTRAL = {
    "logprobs": ((None, False), "kvscope's engine does not return log-probabilities"),
    "top_logprobs": ((None, 0), "kvscope's engine does not return log-probabilities"),
    "prompt_logprobs": ((None,), "kvscope's engine does not return log-probabilities"),
    "echo": ((None, False), "kvscope does not echo the prompt"),
    "suffix": ((None, ""), "kvscope does not do fill-in-the-middle"),
    "best_of": ((None, 1), "kvscope returns every sample it draws; use n"),
    "presence_penalty": ((None, 0, 0.0), "kvscope's sampler has no presence penalty"),
    "frequency_penalty": ((None, 0, 0.0), "kvscope's sampler has no frequency penalty"),
    "repetition_penalty": ((None, 1, 1.0), "kvscope's sampler has no repetition penalty"),
    "min_p": ((None, 0, 0.0), "kvscope's sampler has no min_p"),
    "min_tokens": ((None, 0), "kvscope's sampler cannot forbid an early stop"),
    "logit_bias": ((None, {}), "kvscope's sampler has no logit bias"),
    "tools": ((None, []), "kvscope serves plain text generation, without tool calling"),
    "tool_choice": ((None, "none"), "kvscope serves plain text generation, without tool calling"),
    "response_format": ((None, {"type": "text"}), "kvscope has no guided decoding"),
    "include_stop_str_in_output": ((None, False), "kvscope always cuts the stop string"),
    "skip_special_tokens": ((None, True), "kvscope always skips special tokens in text"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class GenerationRequest(_Strict):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None     # any 64-bit seed
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None     # an end-user id for the caller's own records; it changes nothing here
    # Accepted only at a value that changes nothing; see NEUTRAL.
    presence_penalty: object = None
    frequency_penalty: object = None
    repetition_penalty: object = None
    min_p: object = None
    min_tokens: object = None
    logit_bias: object = None
    logprobs: object = None
    include_stop_str_in_output: object = None
    skip_special_tokens: object = None

    def check_neutral(self) -> None:
        for name in self.model_fields_set & NEUTRAL.keys():
            values, why = NEUTRAL[name]
            value = getattr(self, name)
            if not any(type(value) is type(neutral) and value == neutral for neutral in values):
                raise bad_request(f"{name}={value!r} is not supported: {why}", name)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    prompt: str | Annotated[list[int], Field(min_length=1)] | \
        Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    echo: object = None
    suffix: object = None
    best_of: object = None

    def prompts(self) -> list:
        """One engine prompt per entry: a string, or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class TextPart(BaseModel):
    """A content part; any type parses, so a non-text one can be refused in words (Message.text)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            return ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"messages[{index}]: content parts of type {part.type!r} are not supported: "
                                  "kvscope serves a text-only model", "messages")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    top_logprobs: object = None
    tools: object = None
    tool_choice: object = None
    response_format: object = None
    parallel_tool_calls: bool | None = None    # only means something with tools, which are refused

    def chat(self, max_messages: int) -> list[dict]:
        """The conversation as the engine's chat template takes it."""
        if len(self.messages) > max_messages:
            raise bad_request(f"too many messages: {len(self.messages)}; at most {max_messages} fit in the "
                              f"context (max_model_len {max_messages} tokens)", "messages")
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist.", "model")


# ---- what both endpoints' responses hold ---------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens + completion_tokens,
                   completion_tokens=completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class Choice(BaseModel):
    """What every choice of every response and chunk has; the endpoints add their text, message or delta."""

    index: int
    logprobs: None = None
    finish_reason: str | None
    stop_reason: None = None


class Envelope(BaseModel):
    """What every response body and chunk has around its choices; the endpoints add ``object`` and them."""

    id: str
    created: int
    model: str
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvscope"
    root: str
    parent: None = None
    max_model_len: int
    permission: list = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
