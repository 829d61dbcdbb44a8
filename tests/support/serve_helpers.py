"""A `kvscope serve` for the tests: a tiny random-weight model behind the real server on 127.0.0.1, a free port.

The server runs in a background thread (uvicorn on its own event loop, the engine on its own thread) and
stops by itself when the ``with`` block ends, aborting whatever is still in flight.
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import openai
from models import tiny_model

from kvscope.app.serve.kv_events import KVEventsConfig
from kvscope.app.serve.server import ServeApp, ServeOptions
from kvscope.engine import EngineConfig, LLMEngine

TINY = dict(block_size=16, num_blocks=96, max_model_len=256, dtype="float32", device="cpu", seed=0)


def tiny_engine(**config) -> LLMEngine:
    model, tok = tiny_model("llama")
    return LLMEngine(EngineConfig(**(TINY | config)), model=model, tokenizer=tok)


def ipc_events(tag: str) -> KVEventsConfig:
    stem = f"{tempfile.gettempdir()}/kvscope-test-{tag}-{time.monotonic_ns()}"
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{stem}-events",
                          replay_endpoint=f"ipc://{stem}-replay", topic="kv-events")


@contextlib.contextmanager
def running_server(engine: LLMEngine | None = None, **options):
    """A started ServeApp over ``engine`` (a fresh tiny one by default) on 127.0.0.1, port 0."""
    engine = engine or tiny_engine()
    settings = ServeOptions(**({"host": "127.0.0.1", "port": 0, "served_model_name": "tiny", "access_log": False,
                               "status_interval_s": 3600} | options))
    server = ServeApp(engine, settings)
    server.start_in_thread()
    try:
        yield server
    finally:
        server.stop()


def client(server: ServeApp, api_key: str = "unused", **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=60, **options)


class SlowSteps:
    """An engine observer that makes each step take a while, so a request stays in flight."""

    def __init__(self, seconds: float = 0.02) -> None:
        self.seconds = seconds

    def request_added(self, *args) -> None:
        pass

    def step(self, result) -> None:
        time.sleep(self.seconds)


def count_template_calls(engine: LLMEngine) -> list[int]:
    """Counts the engine tokenizer's apply_chat_template calls: ``[n]``, read after the request."""
    calls = [0]
    apply = engine.tokenizer.apply_chat_template

    def counted(*args, **kwargs):
        calls[0] += 1
        return apply(*args, **kwargs)

    engine.tokenizer.apply_chat_template = counted
    return calls


def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)
