"""What /v1/completions and /v1/chat/completions share: from a checked request to engine requests, and from
their outputs to the body or the event stream the client receives.

An endpoint (chat.py, completions.py) is a Job subclass: it says what its prompts are, what its default reply
length is, and how its response, its chunks and its usage chunk look. Everything else is here, once: the
prompts are tokenized off the event loop and off the engine thread (LLMEngine.tokenize, on the loop's thread
pool), counted against the server's prompt-token budget, then added as one engine request per prompt (``n``
samples each, choice index ``prompt * n + sample``). Whatever ends the request early (a client that
disconnects or stops reading, a server shutting down) releases it, which aborts what has not finished.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fastapi.sse import format_sse_event
from pydantic import BaseModel

from kvscope.app.serve import protocol
from kvscope.app.serve.bridge import EngineBridge, RequestStream
from kvscope.app.serve.errors import APIError, ErrorBody, bad_request
from kvscope.app.serve.logprobs import TokenText
from kvscope.engine.config import RequestError, SamplingParams, model_sampling
from kvscope.engine.outputs import RequestOutput, SampleOutput, TokenLogprob
from kvscope.engine.runner import RunnerInfo

DISCONNECT_POLL_S = 0.5


@dataclass(frozen=True)
class EngineFacts:
    """What the server needs to know about its engine to check and shape requests."""

    model_name: str
    model_root: str
    runner: RunnerInfo
    tokenizer: object = None      # for the text of the tokens that log-probabilities name


class Job:
    """One HTTP generation request. Subclasses (chat.ChatJob, completions.CompletionJob) name their prompt field,
    id prefix, response and chunk types, and say what their prompts, reply length and choices are; the rest of a
    response's shape is here, once."""

    prompt_field = "prompt"     # the request field a refusal of the prompt names
    logprobs_field = "logprobs"     # the one a refusal of the engine's logprobs names
    id_prefix = "cmpl"
    response_type: type[BaseModel]
    chunk_type: type[BaseModel]

    def __init__(self, request: protocol.GenerationRequest, facts: EngineFacts, number: int) -> None:
        protocol.check_model(request.model, facts.model_name)
        request.check_neutral()
        self.request = request
        self.model = facts.model_name
        self.number = number                # the server's count: the engine ids say "http-<number>"
        self.created = int(time.time())
        self.response_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.prompts = self.make_prompts(facts)
        self.token_text = TokenText(facts.tokenizer)

    # --- what an endpoint says ---------------------------------------------------------------------------

    def make_prompts(self, facts: EngineFacts) -> list:
        raise NotImplementedError

    def max_tokens(self) -> int | None:
        """The reply length asked for, or the endpoint's default (None: what is left after the prompt)."""
        raise NotImplementedError

    def choice(self, index: int, sample: SampleOutput, output: RequestOutput) -> BaseModel:
        """One choice of the whole body."""
        raise NotImplementedError

    def delta_choices(self, index: int, output: RequestOutput, new: StreamDelta) -> list[BaseModel]:
        """The choices (one per chunk) for one choice's new output."""
        raise NotImplementedError

    # --- shared ------------------------------------------------------------------------------------------

    @property
    def envelope(self) -> dict:
        """The fields every body and chunk of this response carries (protocol.Envelope's)."""
        return {"id": self.response_id, "created": self.created, "model": self.model}

    @property
    def n(self) -> int:
        return self.request.n

    def body(self, choices: list[tuple[int, SampleOutput, RequestOutput]], usage: protocol.Usage) -> BaseModel:
        return self.response_type(**self.envelope, usage=usage,
                                  choices=[self.choice(index, sample, output) for index, sample, output in choices])

    def chunks(self, index: int, output: RequestOutput, new: StreamDelta) -> list[BaseModel]:
        return [self.chunk_type(**self.envelope, choices=[choice])
                for choice in self.delta_choices(index, output, new)]

    def usage_chunk(self, usage: protocol.Usage) -> BaseModel:
        return self.chunk_type(**self.envelope, choices=[], usage=usage)

    def request_ids(self) -> list[str]:
        """The engine's ids: where the request came from (HTTP) and its number, as the window's queues and
        the run log show them beside chat turns ("chat-3") and presets; a batch's prompts are .0, .1 …"""
        if len(self.prompts) == 1:
            return [f"http-{self.number}"]
        return [f"http-{self.number}.{index}" for index in range(len(self.prompts))]

    def sampling(self, defaults) -> SamplingParams:
        request = self.request
        fields = {"n": request.n, "max_tokens": self.max_tokens(), "ignore_eos": request.ignore_eos,
                  "stop": request.stop if request.stop is not None else (),
                  "stop_token_ids": request.stop_token_ids or ()}
        return model_sampling(defaults, **fields, **request.knobs())

    def refusal(self, exc: RequestError) -> APIError:
        """The engine's refusal as a 400 naming the request field it is about (the engine names its own)."""
        param = {"prompt": self.prompt_field, "structured_output": "response_format",
                 "logprobs": self.logprobs_field}.get(exc.param, exc.param)
        return bad_request(str(exc), param)


class StreamDelta(NamedTuple):
    """What one choice gained since its last chunk: ``text`` None when it gained no token."""

    first: bool
    text: str | None
    logprobs: Sequence[TokenLogprob]
    finish_reason: str | None


async def start(job: Job, bridge: EngineBridge, facts: EngineFacts, admit: Callable[[int], Callable[[], None]]
                ) -> tuple[RequestStream, Callable[[], None]]:
    """Tokenize the job's prompts, take their tokens from the budget (``admit`` returns the release, or raises
    the 503), and queue the engine requests; a refusal is a 400 naming what is wrong."""
    try:
        params = job.sampling(facts.runner.sampling_defaults)
        tokenized = [await bridge.tokenize(prompt) for prompt in job.prompts]
    except RequestError as exc:
        raise job.refusal(exc) from None
    release_tokens = admit(sum(len(prompt.token_ids) for prompt in tokenized))
    try:
        return await bridge.add(tokenized, [params] * len(tokenized), job.request_ids()), release_tokens
    except RequestError as exc:
        release_tokens()
        raise job.refusal(exc) from None
    except BaseException:
        release_tokens()
        raise


def _usage(outputs: list[RequestOutput]) -> protocol.Usage:
    return protocol.Usage.of(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(sample.token_ids) for o in outputs for sample in o.samples),
        sum(o.num_cached_tokens for o in outputs))


def _failed(outputs) -> RequestOutput | None:
    return next((output for output in outputs if output.finish_reason == "error"), None)


async def collect(job: Job, stream: RequestStream, is_disconnected) -> BaseModel | None:
    """The final outputs as one body; None, at once, if the client left (the caller releases the stream, which
    aborts the requests)."""
    finals: dict[str, RequestOutput] = {}
    next_check = time.monotonic() + DISCONNECT_POLL_S
    while not stream.finished:
        try:
            outputs = await asyncio.wait_for(stream.next(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            outputs = []
        if time.monotonic() >= next_check:      # outputs may come every step: look between them too
            if await is_disconnected():
                return None
            next_check = time.monotonic() + DISCONNECT_POLL_S
        finals.update((output.request_id, output) for output in outputs if output.finished)
    ordered = [finals[request_id] for request_id in stream.request_ids]
    failed = _failed(ordered)
    if failed is not None:
        raise APIError(500, f"The engine failed this request: {failed.error}")
    choices = [(prompt_index * job.n + sample.index, sample, output)
               for prompt_index, output in enumerate(ordered) for sample in output.samples]
    return job.body(choices, _usage(ordered))


async def events(job: Job, stream: RequestStream) -> AsyncIterator[bytes]:
    """The stream's chunks as SSE events: one per step that gave a choice tokens, as vLLM sends them (with empty
    text while the detokenizer holds a piece back), so a client timing chunks times tokens; a client that reads
    late gets what it missed in one chunk per choice."""
    sent: dict[int, tuple[int, int]] = {}     # choice index -> (tokens, characters) of it sent
    finished_choices: set[int] = set()
    finals: dict[str, RequestOutput] = {}
    request_index = {request_id: index for index, request_id in enumerate(stream.request_ids)}
    while not stream.finished:
        try:
            outputs = await stream.next()
        except APIError as exc:     # the engine went away mid-stream: say so in the stream, as vLLM does
            yield event(exc.body())
            yield done()
            return
        failed = _failed(outputs)
        if failed is not None:
            yield event(ErrorBody.of(500, f"The engine failed this request: {failed.error}"))
            yield done()
            return
        for output in outputs:
            if output.finished:
                finals[output.request_id] = output
            for sample in output.samples:
                index = request_index[output.request_id] * job.n + sample.index
                for chunk in _chunks(job, index, sample, output, sent, finished_choices):
                    yield event(chunk)
    if job.request.include_usage:
        yield event(job.usage_chunk(_usage([finals[request_id] for request_id in stream.request_ids])))
    yield done()


def _chunks(job: Job, index: int, sample: SampleOutput, output: RequestOutput, sent: dict[int, tuple[int, int]],
            finished_choices: set[int]) -> list[BaseModel]:
    if index in finished_choices:
        return []
    num_tokens, num_chars = sent.get(index, (0, 0))
    first = index not in sent
    sent[index] = (len(sample.token_ids), len(sample.text))
    finish = sample.finish_reason
    if finish is not None:
        finished_choices.add(index)
    moved = len(sample.token_ids) > num_tokens or finish is not None
    logprobs = sample.logprobs[num_tokens:] if sample.logprobs is not None else ()
    return job.chunks(index, output, StreamDelta(first, sample.text[num_chars:] if moved else None, logprobs,
                                                 finish))


def event(body: BaseModel) -> bytes:
    return format_sse_event(data_str=body.model_dump_json())


def done() -> bytes:
    return format_sse_event(data_str="[DONE]")
