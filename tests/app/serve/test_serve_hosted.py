"""kvscope serve in front of an engine that another thread steps (as the window's engine worker does): requests wake
that thread, and when it replaces its engine the requests in flight end with a 503 saying why, subscribers hear
AllBlocksCleared, and the next requests are served by the new engine."""

from __future__ import annotations

import json
import threading

import httpx
import zmq
from serve_helpers import SlowSteps, client, ipc_events, tiny_engine, wait_until

from kvscope.app.attach.feed.pool import PoolModel
from kvscope.app.attach.feed.server import make_client, probe_server
from kvscope.app.attach.feed.subscriber import Delivery, EventStream
from kvscope.app.serve.hosted import HostedServe
from kvscope.app.serve.server import ServeOptions


class Host:
    """Steps whichever engine it holds while that engine has work, running the server's engine calls between
    steps, as the window's worker does; woken when the server has calls for it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.hosted = None
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.hosted is not None:
                self.hosted.run_pending()
            engine = self.engine
            if engine.has_unfinished_requests():
                engine.step()
            else:
                self.wake.wait(1.0)     # long: only a wake-up makes the test fast
                self.wake.clear()

    def close(self) -> None:
        self.stop.set()
        self.wake.set()
        self.thread.join(10)


def test_a_hosted_server_follows_its_hosts_engine():
    first, second = tiny_engine(), tiny_engine()
    first.add_observer(SlowSteps())
    host = Host(first)
    options = ServeOptions(port=0, served_model_name="tiny", access_log=False, status_interval_s=3600,
                           kv_events=ipc_events("hosted"))
    hosted = HostedServe(options)
    hosted.wake = host.wake.set
    host.hosted = hosted
    hosted.engine_installed(first)
    server = hosted.server
    http, context, streams = make_client(), zmq.Context(), []
    try:
        api = client(server)
        assert api.completions.create(model="tiny", prompt="hello", max_tokens=3).usage.completion_tokens == 3
        info, _ = probe_server(http, server.url)
        events = EventStream(context, info.event_sources[0])
        streams.append(events)
        pool = PoolModel(info.num_gpu_blocks, info.block_size)
        events.bootstrap()
        deliveries = events.wait_for_replay()
        body = {"model": "tiny", "prompt": " ".join(["word"] * 40), "max_tokens": 150, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=60) as web, web.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            host.engine = second
            hosted.engine_installed(second)
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
        error = json.loads(rest[-2])["error"]
        assert rest[-1] == "[DONE]" and error["code"] == 503 and "rebuilt its engine" in error["message"]
        reply = api.completions.create(model="tiny", prompt="hello", max_tokens=3)
        assert reply.usage.completion_tokens == 3 and second.step_counter > 0
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1.0' in metrics
        wait_until(lambda: deliveries.extend(events.drain()) or any(
            type(event).__name__ == "AllBlocksCleared" for item in deliveries if isinstance(item, Delivery)
            for event in item.batch.events))
        for item in deliveries:
            if isinstance(item, Delivery):
                pool.apply(item.batch.events)
        assert pool.counters.num_cleared == 1
    finally:
        for stream in streams:
            stream.close()
        context.term()
        http.close()
        hosted.close()
        host.close()
