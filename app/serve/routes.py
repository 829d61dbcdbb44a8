"""The ASGI app: vLLM's routes over kvscope's engine.

``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` are the OpenAI API (the key, when set, is
checked on every ``/v1`` route); ``/health``, ``/version``, ``/metrics`` and ``/kv_event_sources`` answer as
vLLM's do, so ``kvscope attach`` and vLLM's tooling find what they look for. Bodies are read and checked
here (not by FastAPI's own validation) so that every refusal, a malformed body included, has the OpenAI
error shape.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvscope import __version__
from kvscope.app.serve import completions, protocol
from kvscope.app.serve.bridge import EngineBridge
from kvscope.app.serve.completions import EngineFacts
from kvscope.app.serve.errors import APIError, error_body, from_validation_error
from kvscope.app.serve.limits import BodyLimit, ConcurrencyLimit, check_api_key

CLIENT_CLOSED_REQUEST = 499


@dataclass
class ServeState:
    bridge: EngineBridge
    facts: EngineFacts
    concurrency: ConcurrencyLimit
    metrics: object                     # ServeMetrics: render() -> the Prometheus page
    event_sources: dict                 # GET /kv_event_sources
    api_key: str | None = None
    dev_routes: bool = False            # POST /reset_prefix_cache, as vLLM's dev mode has it
    started: int = field(default_factory=lambda: int(time.time()))
    numbers: itertools.count = field(default_factory=lambda: itertools.count(1))   # the requests served


def build_app(state: ServeState, max_body_bytes: int) -> FastAPI:
    app = FastAPI(title="kvscope serve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.add_middleware(BodyLimit, limit=max_body_bytes)
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

    app.include_router(_v1(state))
    return app


def _v1(state: ServeState) -> APIRouter:
    def key(request: Request) -> None:
        check_api_key(state.api_key, request.headers.get("authorization"))

    router = APIRouter(prefix="/v1", dependencies=[Depends(key)])

    @router.get("/models")
    async def models() -> dict:
        facts = state.facts
        return {"object": "list", "data": [protocol.model_card(facts.model_name, facts.model_root,
                                                               facts.max_model_len, state.started)]}

    @router.post("/completions")
    async def create_completion(request: Request) -> Response:
        return await _generate(state, request, protocol.CompletionRequest, chat=False)

    @router.post("/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await _generate(state, request, protocol.ChatCompletionRequest, chat=True)

    return router


async def _generate(state: ServeState, request: Request, model, chat: bool) -> Response:
    body = await request.body()
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    job = completions.new_job(chat, parsed, state.facts, next(state.numbers))
    if not state.bridge.accepting:
        raise APIError(503, "The server is shutting down")
    state.concurrency.acquire()
    try:
        stream = await completions.start(job, state.bridge, state.facts)
    except BaseException:
        state.concurrency.release()
        raise
    released = []

    def release() -> None:
        if not released:
            released.append(True)
            state.bridge.release(stream)
            state.concurrency.release()

    if parsed.stream:
        return _EventStream(completions.events(job, stream), on_close=release, headers={"cache-control": "no-cache"})
    try:
        body = await completions.collect(job, stream, request.is_disconnected)
    finally:
        release()
    # Nobody reads the answer to a client that left; 499 is what proxies log for it.
    return JSONResponse(body) if body is not None else Response(status_code=CLIENT_CLOSED_REQUEST)


class _EventStream(EventSourceResponse):
    """Server-sent events that release their request however the response ends: finished, the client gone
    (Starlette cancels the response), or never started."""

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
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)
