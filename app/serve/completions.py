"""One /v1/completions or /v1/chat/completions request, from its checked body to the body or the event stream
the client receives.

A Job turns the request into engine requests (one per prompt; ``n`` samples each, choice index
``prompt * n + sample``), then either collects their final outputs into one body, or streams them as
server-sent events: a chunk per new token per choice, the finish reason when a choice ends, the usage
chunk when ``stream_options.include_usage`` asks for it, then ``[DONE]``. Whatever ends the request early (a
client that disconnects, a server shutting down) releases it, which aborts whatever has not finished.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.sse import format_sse_event

from kvscope.app.serve import protocol
from kvscope.app.serve.bridge import EngineBridge, RequestStream
from kvscope.app.serve.errors import APIError, bad_request, error_body
from kvscope.engine.config import RequestError
from kvscope.engine.outputs import RequestOutput

DEFAULT_COMPLETION_MAX_TOKENS = 16     # OpenAI's and vLLM's default for /v1/completions
DISCONNECT_POLL_S = 0.5


@dataclass(frozen=True)
class EngineFacts:
    """What the server needs to know about its engine to check and shape requests."""

    model_name: str
    model_root: str
    max_model_len: int
    num_blocks: int
    block_size: int
    sampling_defaults: tuple
    tokenizer: object


@dataclass
class Job:
    chat: bool
    request: protocol.CompletionRequest | protocol.ChatCompletionRequest
    prompts: list
    response_id: str
    model: str
    number: int = 0                     # the server's count of requests: the engine ids say "http-<number>"
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.request.n

    def request_ids(self) -> list[str]:
        """The engine's ids: where the request came from (HTTP) and its number, as the window's queues and
        the run log show them beside chat turns ("chat-3") and presets; a batch's prompts are .0, .1 …"""
        if len(self.prompts) == 1:
            return [f"http-{self.number}"]
        return [f"http-{self.number}.{index}" for index in range(len(self.prompts))]


def new_job(chat: bool, request, facts: EngineFacts, number: int) -> Job:
    protocol.check_model(request.model, facts.model_name)
    request.check_neutral()
    if chat:
        prompts = [request.chat(max_messages=facts.max_model_len)]
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
    else:
        prompts = request.prompts()
        response_id = f"cmpl-{uuid.uuid4().hex}"
    return Job(chat, request, prompts, response_id, facts.model_name, number)


async def start(job: Job, bridge: EngineBridge, facts: EngineFacts) -> RequestStream:
    """Queue the job's engine requests; a refusal is a 400 naming what is wrong."""
    try:
        params = [job.request.sampling(await _max_tokens(job, prompt, facts), facts.sampling_defaults)
                  for prompt in job.prompts]
        return await bridge.add(job.prompts, params, job.request_ids())
    except RequestError as exc:
        raise bad_request(str(exc), _param_of(str(exc), job.chat)) from None


async def _max_tokens(job: Job, prompt, facts: EngineFacts) -> int:
    """The request's max_tokens, or the default: 16 for completions; for chat, what is left of the context
    (and of the pool) after the prompt, as vLLM does."""
    asked = job.request.requested_max_tokens if job.chat else job.request.max_tokens
    if asked is not None:
        return asked
    if not job.chat:
        return DEFAULT_COMPLETION_MAX_TOKENS
    prompt_tokens = await asyncio.to_thread(_count_chat_tokens, facts.tokenizer, prompt)
    room = min(facts.max_model_len, (facts.num_blocks // job.n) * facts.block_size + 1) - prompt_tokens
    if room < 1:
        raise bad_request(f"the prompt is {prompt_tokens} tokens, which leaves no room for a reply within "
                          f"max_model_len ({facts.max_model_len})", "messages")
    return room


def _count_chat_tokens(tokenizer, messages: list[dict]) -> int:
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the engine says the same, in the same words, when it sees the messages
        raise bad_request(f"the chat template refused these messages: {type(exc).__name__}: {exc}",
                          "messages") from None
    return len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _param_of(message: str, chat: bool) -> str | None:
    """The request field an engine refusal is about, for the error body's ``param``."""
    for name in ("max_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop", "seed", "n"):
        if message.startswith(name):
            return name
    if "max_model_len" in message or "prompt" in message or "KV cache" in message or "chat" in message:
        return "messages" if chat else "prompt"
    return None


# ---- the whole body at once --------------------------------------------------------------------------------

async def collect(job: Job, stream: RequestStream, is_disconnected) -> dict | None:
    """The final outputs as one body; None, at once, if the client left (the caller releases the stream, which
    aborts the requests)."""
    finals: dict[str, RequestOutput] = {}
    next_check = time.monotonic() + DISCONNECT_POLL_S
    while not stream.finished:
        try:
            output = await asyncio.wait_for(stream.next(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            output = None
        if time.monotonic() >= next_check:      # outputs may come every step: look between them too
            if await is_disconnected():
                return None
            next_check = time.monotonic() + DISCONNECT_POLL_S
        if output is not None and output.finished:
            finals[output.request_id] = output
    ordered = [finals[request_id] for request_id in stream.request_ids]
    failed = next((output for output in ordered if output.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(500, f"The engine failed this request: {failed.error}")
    choices = []
    for prompt_index, output in enumerate(ordered):
        for sample in output.samples:
            index = prompt_index * job.n + sample.index
            make = protocol.chat_choice if job.chat else protocol.completion_choice
            choices.append(make(index, sample.text, sample.finish_reason))
    kind = "chat.completion" if job.chat else "text_completion"
    return protocol.envelope(kind, job.response_id, job.created, job.model, choices, usage=_usage(ordered))


def _usage(outputs: list[RequestOutput]) -> dict:
    return protocol.usage(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(sample.token_ids) for o in outputs for sample in o.samples),
        sum(o.num_cached_tokens for o in outputs))


# ---- server-sent events ------------------------------------------------------------------------------------

async def events(job: Job, stream: RequestStream) -> AsyncIterator[bytes]:
    """The stream's chunks as SSE events."""
    sent: dict[int, tuple[int, int]] = {}     # choice index -> (tokens, characters) of it sent
    finished_choices: set[int] = set()
    finals: dict[str, RequestOutput] = {}
    request_index = {request_id: index for index, request_id in enumerate(stream.request_ids)}
    while not stream.finished:
        try:
            output = await stream.next()
        except APIError as exc:     # the engine went away mid-stream: say so in the stream, as vLLM does
            yield _event(exc.body())
            yield format_sse_event(data_str="[DONE]")
            return
        if output.finish_reason == "error":
            yield _event(error_body(500, f"The engine failed this request: {output.error}"))
            yield format_sse_event(data_str="[DONE]")
            return
        if output.finished:
            finals[output.request_id] = output
        for sample in output.samples:
            index = request_index[output.request_id] * job.n + sample.index
            for chunk in _chunks(job, index, sample, sent, finished_choices):
                yield _event(chunk)
    if job.request.include_usage:
        ordered = [finals[request_id] for request_id in stream.request_ids]
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        yield _event(protocol.envelope(kind, job.response_id, job.created, job.model, [], usage=_usage(ordered)))
    yield format_sse_event(data_str="[DONE]")


def _chunks(job: Job, index: int, sample, sent: dict[int, tuple[int, int]], finished_choices: set[int]) -> list:
    """The chunks one choice's new output makes: one per step that gave it tokens, as vLLM sends them (with
    empty text while the detokenizer holds a piece back), so a client timing chunks times tokens."""
    if index in finished_choices:
        return []
    num_tokens, num_chars = sent.get(index, (0, 0))
    first = index not in sent
    sent[index] = (len(sample.token_ids), len(sample.text))
    finish = sample.finish_reason
    if finish is not None:
        finished_choices.add(index)
    chunks = []
    if job.chat and first:
        chunks.append(protocol.chat_delta(index, {"role": "assistant", "content": ""}, None))
    if len(sample.token_ids) > num_tokens or finish is not None:
        delta = sample.text[num_chars:]
        choice = protocol.chat_delta(index, {"content": delta}, finish) if job.chat else \
            protocol.completion_choice(index, delta, finish)
        chunks.append(choice)
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    extra = {"usage": None} if job.request.include_usage else {}
    return [protocol.envelope(kind, job.response_id, job.created, job.model, [choice], **extra)
            for choice in chunks]


def _event(body: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(body, ensure_ascii=False, separators=(",", ":")))
