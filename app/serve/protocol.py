"""The OpenAI request bodies kvscope accepts, checked by pydantic, and the response bodies it sends.

Field names and defaults are OpenAI's and vLLM's (vLLM's extensions: top_k, min_p, repetition_penalty,
min_tokens, bad_words, ignore_eos, stop_token_ids, prompt_logprobs). Models are strict (a string is not a
number). A field nobody here knows is ignored, as vLLM ignores it, and the server logs one warning line naming
it (clients send extras of their own). A parameter kvscope knows but cannot honour (tool calling, best_of) is
accepted only at the value that changes nothing; any other value is refused by name, with the reason.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvscope.app.serve.errors import APIError, bad_request
from kvscope.engine.config import MAX_LOGPROBS

MAX_N = 32              # samples per prompt; the engine also checks that they fit the pool
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64        # prompts in one batched /v1/completions request
MAX_INT = 2**31 - 1     # the largest count or seed taken: a 4,000-digit number is refused, not carried along
MAX_COMPLETION_LOGPROBS = 5     # OpenAI's limit for /v1/completions' logprobs

# name -> (values that change nothing, why kvscope cannot do anything else)
NEUTRAL = {
    "suffix": ((None, ""), "kvscope does not do fill-in-the-middle"),
    "best_of": ((None, 1), "kvscope returns every sample it draws; use n"),
    "tools": ((None, []), "kvscope serves plain text generation, without tool calling"),
    "tool_choice": ((None, "none"), "kvscope serves plain text generation, without tool calling"),
    "include_stop_str_in_output": ((None, False), "kvscope always cuts the stop string"),
    "skip_special_tokens": ((None, True), "kvscope always skips special tokens in text"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Body(BaseModel):
    """A request body: strict, and what it does not name is kept aside (``model_extra``) to be warned of."""

    model_config = ConfigDict(extra="allow", strict=True)

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class JSONSchema(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None

    def structured_output(self) -> tuple[str, object] | None:
        """The engine's SamplingParams.structured_output for this format."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ("json_object", None)
        if self.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema", "response_format")
        return ("json_schema", self.json_schema.json_schema or {})


Penalty = Annotated[float, Field(ge=-2, le=2)]


class GenerationRequest(_Body):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None     # any 64-bit seed
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None     # an end-user id for the caller's own records; it changes nothing here
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] = 0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    # Accepted only at a value that changes nothing; see NEUTRAL.
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

    @property
    def top_logprob_count(self) -> int | None:
        """How many top log-probabilities each sampled token reports (0: its own only); None: none asked."""
        raise NotImplementedError

    def knobs(self) -> dict:
        """The SamplingParams fields this request sets beyond the endpoint's own."""
        fields = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "bad_words", "prompt_logprobs") if getattr(self, name) is not None}
        if self.logit_bias:
            fields["logit_bias"] = {_token_id(key): value for key, value in self.logit_bias.items()}
        if self.response_format is not None:
            fields["structured_output"] = self.response_format.structured_output()
        return fields | {"min_tokens": self.min_tokens, "logprobs": self.top_logprob_count}


def _token_id(key: str) -> int:
    if not key.isascii() or not key.isdigit():
        raise bad_request(f"logit_bias: {key!r} is not a token id", "logit_bias")
    return int(key)


class CompletionRequest(GenerationRequest):
    prompt: str | Annotated[list[int], Field(min_length=1)] | \
        Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: object = None
    best_of: object = None

    @property
    def top_logprob_count(self) -> int | None:
        return self.logprobs

    def knobs(self) -> dict:
        fields = super().knobs()
        if self.echo and self.logprobs is not None:     # the echoed prompt's tokens get theirs too
            fields["prompt_logprobs"] = max(self.prompt_logprobs or 0, self.logprobs)
        return fields

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
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: object = None
    tool_choice: object = None
    parallel_tool_calls: bool | None = None    # only means something with tools, which are refused

    @property
    def top_logprob_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

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
    """What every choice of every response and chunk has; the endpoints add their text, message or delta, and
    their shape of log-probabilities."""

    index: int
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
