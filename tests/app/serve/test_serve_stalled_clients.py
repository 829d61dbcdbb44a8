"""A client that stops reading its stream, or a prompt that takes long to tokenize, costs the server a bounded,
short while: the stream keeps a few outputs (they are cumulative), a client whose socket takes no bytes past the
write deadline is dropped with its requests aborted and blocks freed, and tokenizing happens off the engine
thread, a prompt too long to fit by its length alone refused before any."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
from serve_helpers import running_server, tiny_engine, wait_until

from kvscope.app.serve.bridge import MAX_BUFFERED_PER_REQUEST
from kvscope.engine import EngineConfig
from kvscope.engine.fake_runner import fake_engine


class Finals:
    """An engine observer keeping every final output, and making each step last a millisecond as a real model's
    would: the FakeRunner alone ran 6,000 steps of 32 samples inside the one-second write deadline on a quiet
    machine, so the requests finished by length before the stalled client could be dropped."""

    def __init__(self) -> None:
        self.outputs: list = []

    def request_added(self, *args) -> None:
        pass

    def step(self, result) -> None:
        self.outputs += [output for output in result.outputs if output.finished]
        time.sleep(0.001)


def test_a_client_that_never_reads_holds_bounded_memory_and_is_aborted_with_its_blocks_freed():
    config = EngineConfig(num_blocks=16384, block_size=16, max_model_len=8192)
    engine = fake_engine(config, max_model_len=8192, verify=False)
    finals = Finals()
    engine.add_observer(finals)
    body = json.dumps({"model": "fake", "prompt": "hello " * 20, "n": 32, "max_tokens": 6000, "ignore_eos": True,
                       "stream": True}).encode()
    with running_server(engine, served_model_name="fake", write_stall_s=1.0) as server:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)    # fills after a few chunks
        stalled.connect(("127.0.0.1", server.port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(body), body))
        buffered: list[int] = []

        def aborted() -> bool:
            buffered.extend(stream.num_buffered for stream in list(server.bridge._streams.values()))
            return bool(finals.outputs)

        wait_until(aborted, timeout_s=60)
        (final,) = finals.outputs
        assert final.finish_reason == "abort"
        assert 0 < len(final.samples[0].token_ids) < 6000     # it ran, then the stalled client was dropped
        assert max(buffered) <= MAX_BUFFERED_PER_REQUEST       # never more, however many steps went by
        wait_until(lambda: not engine.has_unfinished_requests())
        assert engine.scheduler.cache_state().num_free_blocks == config.num_blocks     # every block back
        stalled.close()
        reply = httpx.post(f"{server.url}/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200


def test_prompts_are_tokenized_off_the_engine_thread_and_one_too_long_by_its_length_is_never_tokenized():
    engine = tiny_engine()
    threads: list[str] = []
    encode = engine.tokenizer.encode

    def recording_encode(text, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)

    engine.tokenizer.encode = recording_encode
    with running_server(engine) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        reply = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 2})
        assert reply.status_code == 200 and threads and "kvscope-serve-engine" not in threads
        threads.clear()
        huge = "x" * (engine.max_model_len * engine.prompts._max_token_chars + 1)
        refused = http.post("/v1/completions", json={"model": "tiny", "prompt": huge, "max_tokens": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
        assert "exceed max_model_len" in refused.json()["error"]["message"]
        assert threads == []      # refused by its length: the tokenizer never saw it
