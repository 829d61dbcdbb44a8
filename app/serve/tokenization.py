"""/tokenize and /detokenize, in vLLM's request and response shapes: what clients such as lm-evaluation-harness
call to count and split text with the served model's own tokenizer. Both run on a thread of the event loop's
pool, never on the engine's."""

from __future__ import annotations

import asyncio
from typing import Annotated

from pydantic import BaseModel, Field

from kvscope.app.serve import protocol
from kvscope.app.serve.errors import APIError, bad_request
from kvscope.app.serve.generation import EngineFacts


class TokenizeRequest(protocol._Body):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[protocol.Message], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None      # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(protocol._Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


def _tokenizer(facts: EngineFacts):
    if facts.tokenizer is None:
        raise APIError(404, "This server's engine has no tokenizer")
    return facts.tokenizer


async def tokenize(request: TokenizeRequest, facts: EngineFacts) -> TokenizeResponse:
    protocol.check_model(request.model, facts.model_name)
    tokenizer = _tokenizer(facts)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("send either prompt or messages", "prompt")

    def encode() -> list[int]:
        if request.prompt is not None:
            return list(tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens is not False))
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(request.messages)]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                                tokenize=True, return_dict=True)
        return list(encoded["input_ids"])

    try:
        tokens = await asyncio.to_thread(encode)
    except Exception as exc:     # the tokenizer's or the chat template's own refusal
        raise bad_request(f"cannot tokenize this input: {exc}", "messages" if request.messages else "prompt") from None
    strings = tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=facts.runner.max_model_len, tokens=tokens,
                            token_strs=strings)


async def detokenize(request: DetokenizeRequest, facts: EngineFacts) -> DetokenizeResponse:
    protocol.check_model(request.model, facts.model_name)
    tokenizer = _tokenizer(facts)
    vocab = facts.runner.vocab_size
    outside = [token for token in request.tokens if token >= vocab]
    if outside:
        raise bad_request(f"token id {outside[0]} is outside the vocabulary (vocab_size {vocab})", "tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, request.tokens))
