"""The ASGI app: vLLM's routes over kvscope's engine.

``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` are the OpenAI API; ``/tokenize`` and
``/detokenize`` are vLLM's (the key, when set, is checked on all of these); ``/health``, ``/version``,
``/metrics`` and ``/kv_event_sources`` answer as vLLM's do, so ``kvscope attach`` and vLLM's tooling find what
they look for. Bodies are read and checked here (not by FastAPI's own validation) so that every refusal, a
malformed body included, has the OpenAI error shape.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvscope import __version__
from kvscope.app.serve import generation, protocol, tokenization
from kvscope.app.serve.bridge import EngineBridge
from kvscope.app.serve.chat import ChatJob
from kvscope.app.serve.completions import CompletionJob
from kvscope.app.serve.errors import APIError, ErrorBody, from_validation_error, lone_surrogate
from kvscope.app.serve.generation import EngineFacts, Job
from kvscope.app.serve.limits import BODY_READ_DEADLINE_S, BodyLimit, ConcurrencyLimit, PromptTokenBudget, check_api_key

CLIENT_CLOSED_REQUEST = 499
log = logging.getLogger("kvscope.serve")


@dataclass
class ServeState:
    bridge: EngineBridge
    facts: EngineFacts
    concurrency: ConcurrencyLimit
    metrics: object                     # ServeMetrics: render() -> the Prometheus page
    event_sources: dict                 # GET /kv_event_sources
    prompt_tokens: PromptTokenBudget
    api_key: str | None = None
    dev_routes: bool = False            # POST /reset_prefix_cache, as vLLM's dev mode has it
    started: int = field(default_factory=lambda: int(time.time()))
    numbers: itertools.count = field(default_factory=lambda: itertools.count(1))   # the requests served


def build_app(state: ServeState, max_body_bytes: int, body_read_deadline_s: float = BODY_READ_DEADLINE_S) -> FastAPI:
    app = FastAPI(title="kvscope serve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.add_middleware(BodyLimit, limit=max_body_bytes, read_deadline_s=body_read_deadline_s)
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    app.add_exception_handler(StarletteHTTPException, _http_error)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.bridge.accepting else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": f"kvscope {__version__}"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> dict:
        return state.event_sources

    if state.dev_routes:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request) -> Response:
            check_api_key(state.api_key, request.headers.get("authorization"))
            if not await state.bridge.reset_prefix_cache():
                raise APIError(409, "The prefix cache cannot be reset while requests hold blocks; retry when idle")
            return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        check_api_key(state.api_key, request.headers.get("authorization"))
        parsed = _parse(await request.body(), tokenization.TokenizeRequest, request.url.path)
        return (await tokenization.tokenize(parsed, state.facts)).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        check_api_key(state.api_key, request.headers.get("authorization"))
        parsed = _parse(await request.body(), tokenization.DetokenizeRequest, request.url.path)
        return (await tokenization.detokenize(parsed, state.facts)).model_dump()

    app.include_router(_v1(state))
    return app


def _v1(state: ServeState) -> APIRouter:
    def key(request: Request) -> None:
        check_api_key(state.api_key, request.headers.get("authorization"))

    router = APIRouter(prefix="/v1", dependencies=[Depends(key)])

    @router.get("/models")
    async def models() -> dict:
        facts = state.facts
        card = protocol.ModelCard(id=facts.model_name, root=facts.model_root, created=state.started,
                                  max_model_len=facts.runner.max_model_len)
        return protocol.ModelList(data=[card]).model_dump()

    @router.post("/completions")
    async def create_completion(request: Request) -> Response:
        return await _generate(state, request, protocol.CompletionRequest, CompletionJob)

    @router.post("/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await _generate(state, request, protocol.ChatCompletionRequest, ChatJob)

    return router


def _parse(body: bytes, model, path: str):
    """The body as ``model``; its fields nobody here knows are ignored, as vLLM ignores them, with one warning."""
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        error = from_validation_error(exc)
        if exc.errors()[0]["type"] == "json_invalid" and _python_reads(body):
            error = lone_surrogate()    # the one JSON text Python reads and pydantic refuses
        raise error from None
    if parsed.unknown_fields:
        log.warning("%s: ignored the request's unknown fields: %s", path, ", ".join(parsed.unknown_fields)[:300])
    return parsed


def _python_reads(body: bytes) -> bool:
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


async def _generate(state: ServeState, request: Request, model, make_job: type[Job]) -> Response:
    parsed = _parse(await request.body(), model, request.url.path)
    job = make_job(parsed, state.facts, next(state.numbers))
    if not state.bridge.accepting:
        raise APIError(503, "The server is shutting down")
    state.concurrency.acquire()
    try:
        stream, release_tokens = await generation.start(job, state.bridge, state.facts, state.prompt_tokens.admit)
    except BaseException:
        state.concurrency.release()
        raise
    released = []

    def release() -> None:
        if not released:
            released.append(True)
            state.bridge.release(stream)
            release_tokens()
            state.concurrency.release()

    if parsed.stream:
        return _EventStream(generation.events(job, stream), on_close=release, headers={"cache-control": "no-cache"})
    try:
        body = await generation.collect(job, stream, request.is_disconnected)
    finally:
        release()
    # Nobody reads the answer to a client that left; 499 is what proxies log for it.
    return JSONResponse(body.model_dump()) if body is not None else Response(status_code=CLIENT_CLOSED_REQUEST)


class _EventStream(EventSourceResponse):
    """Server-sent events that release their request however the response ends: finished, the client gone
    (Starlette cancels the response; a client that stopped reading is cut by connections.DeadlineProtocol),
    or never started."""

    def __init__(self, content, on_close, **options) -> None:
        super().__init__(content, **options)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (an unknown route, a wrong method) in the same shape as ours."""
    message = {404: f"Not found: {request.method} {request.url.path}",
               405: f"Method not allowed: {request.method} {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(ErrorBody.of(exc.status_code, message).model_dump(), status_code=exc.status_code,
                        headers=exc.headers)
