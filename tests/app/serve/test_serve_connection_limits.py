"""The HTTP layer's limits: a trickled head is cut, a body declared too large gets its 413 at once, one that
stops arriving a 408, connections are capped under the open-file limit (raised to the hard limit), the
accept-error log is rate-limited, and prompt tokens in flight are bounded by a budget tied to the pool."""

from __future__ import annotations

import logging
import resource
import socket

import httpx
import pytest
from serve_helpers import SlowSteps, running_server, tiny_engine, wait_until

from kvscope.app.serve.connections import AcceptErrorFilter, DeadlineProtocol, raise_file_limit
from kvscope.app.serve.limits import PromptTokenBudget

GOOD = {"model": "tiny", "prompt": "Hello there", "max_tokens": 2}


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(20)     # a bound for a broken server, far above what a working one takes
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_head_that_never_completes_is_cut_at_the_deadline(server, monkeypatch):
    monkeypatch.setattr(DeadlineProtocol, "head_deadline_s", 0.5)
    with socket.create_connection(("127.0.0.1", server.port)) as trickler:
        trickler.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")     # and nothing more
        assert read_all(trickler) == b""    # closed by the server, not by the test's timeout
    assert httpx.post(f"{server.url}/v1/completions", json=GOOD).status_code == 200


def test_a_body_declared_too_large_is_refused_at_once_though_never_sent(server):
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: 1000000000\r\n\r\n")
        client.settimeout(20)
        assert client.recv(65536).startswith(b"HTTP/1.1 413 ")


def test_a_body_that_stops_arriving_gets_a_408():
    with running_server(body_read_deadline_s=0.5) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           b"content-length: 100\r\n\r\n{\"model\":")
            assert read_all(client).startswith(b"HTTP/1.1 408 ")


def test_the_open_file_limit_is_raised_to_the_hard_one_and_caps_the_connections():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        raised = raise_file_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
        assert raised == (hard if hard != resource.RLIM_INFINITY else raised) and raised >= min(1024, hard)
        with running_server(max_connections=10**9) as server:
            limit = server.server.config.limit_concurrency
            assert limit is not None and limit < raised
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_accept_errors_are_logged_once_per_interval_with_a_count():
    now = [0.0]
    only = AcceptErrorFilter(interval_s=10, clock=lambda: now[0])
    record = lambda: logging.LogRecord("asyncio", logging.ERROR, __file__, 1,  # noqa: E731
                                       "socket.accept() out of system resource", None, None)
    passed = [only.filter(record()) for _ in range(1000)]
    assert passed.count(True) == 1
    now[0] = 11
    last = record()
    assert only.filter(last) and "999 more" in last.getMessage()
    assert only.filter(logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "other", None, None))


def test_prompt_tokens_in_flight_are_bounded_and_past_the_budget_a_503_says_when_to_retry():
    budget = PromptTokenBudget(100)
    release = budget.admit(80)
    with pytest.raises(Exception) as refused:
        budget.admit(30)
    assert refused.value.status == 503 and refused.value.headers == {"retry-after": "1"}
    release()
    release()                           # once only
    assert budget.held == 0
    budget.admit(500)()                 # one larger than the budget goes in alone
    engine = tiny_engine(num_blocks=4)  # 64 tokens a pool: a budget of 256 prompt tokens
    engine.add_observer(SlowSteps())
    with running_server(engine) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert server.state.prompt_tokens.limit == 4 * 4 * 16
        long = GOOD | {"prompt": [7] * 40, "max_tokens": 20, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long) as first, \
                http.stream("POST", "/v1/completions", json=long | {"prompt": [[7] * 40] * 5}) as second:
            assert first.status_code == 200 and second.status_code == 200
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            third = http.post("/v1/completions", json=long | {"prompt": [[7] * 40] * 2, "stream": False})
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert "prompt tokens" in third.json()["error"]["message"]
        wait_until(lambda: server.state.prompt_tokens.held == 0)
