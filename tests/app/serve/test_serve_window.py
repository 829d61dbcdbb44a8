"""`kvscope --serve PORT`: the window and the server on one engine. HTTP requests run on the window's engine
thread, show in its queues as http-N beside chat turns, and the window's quitting ends them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from app_harness import FakeEngines, make_app, single_steps, started, until

from kvscope.app.serve.hosted import HostedServe
from kvscope.app.serve.server import ServeOptions
from kvscope.app.widgets.queues import QueuesTable

pytestmark = pytest.mark.anyio


async def test_http_requests_run_on_the_windows_engine_and_show_in_its_queues():
    serve = HostedServe(ServeOptions(port=0, served_model_name="fake"))
    app = make_app(FakeEngines(), serve=serve)      # paused: the fake engine would finish 300 steps unseen
    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        assert serve.url is not None
        queues = app.main.query_one(QueuesTable)
        async with httpx.AsyncClient(base_url=serve.url, timeout=60) as http:
            sending = asyncio.create_task(http.post("/v1/completions", json={
                "model": "fake", "prompt": "hello there", "max_tokens": 300, "ignore_eos": True}))
            # Added by the engine thread, paused or not.
            await until(pilot, lambda: app.worker.engine.has_unfinished_requests())
            await single_steps(pilot, 1)
            row = queues.rows["http-1"]                             # running, beside any chat turn
            assert row[0] == "http-1" and "hello there" in row[2]
            await pilot.press("f2")                                 # resume: it runs to its end
            reply = await sending
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 300
        await until(pilot, lambda: "http-1" in queues.finished)
        engine = app.worker.engine
        assert serve.server.engine is engine and not engine.has_unfinished_requests()
    assert serve.server._closed     # the window's quitting stopped the server


async def test_quitting_the_window_ends_every_stream_with_abort_and_done():
    serve = HostedServe(ServeOptions(port=0, served_model_name="fake"))
    app = make_app(FakeEngines(), serve=serve)      # paused: the request waits, in flight, until the quit
    lines: list[str] = []

    async def stream() -> None:
        async with httpx.AsyncClient(base_url=serve.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json={
                    "model": "fake", "prompt": "hello there", "max_tokens": 300, "ignore_eos": True,
                    "stream": True}) as response:
                lines.extend([line async for line in response.aiter_lines() if line.startswith("data: ")])

    async with app.run_test(size=(160, 48)) as pilot:
        await started(pilot)
        streaming = asyncio.create_task(stream())
        await until(pilot, lambda: app.worker.engine.has_unfinished_requests())
        app.shut_down()
        await until(pilot, lambda: streaming.done())
        await streaming
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"abort"' in lines[-2]
    assert serve.server._closed
