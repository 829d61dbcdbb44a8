"""One chat template per request, refusals that stay short and clear (a 4,000-digit number, a lone surrogate,
an empty stop string), the warnings a user needs at start (KV events on the network, a pool smaller than one
request), and the fit rule in one place."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import count_template_calls, running_server, tiny_engine

from kvscope.app.serve.kv_events import KVEventsConfig, exposure_warning
from kvscope.engine.config import RequestError, SamplingParams
from kvscope.engine.runner import pool_warning

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}]}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def http(engine):
    with running_server(engine) as server, httpx.Client(base_url=server.url, timeout=30) as session:
        yield session


def test_an_http_chat_request_applies_the_chat_template_once(engine, http):
    calls = count_template_calls(engine)
    reply = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 3})
    assert reply.status_code == 200 and calls == [1]
    calls[0] = 0
    reply = http.post("/v1/chat/completions", json=CHAT)    # no max_tokens: what is left after the prompt
    assert reply.status_code == 200 and calls == [1]
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= engine.max_request_tokens(1)


def test_a_4000_digit_max_tokens_is_not_echoed_whole(http):
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 4000 + b"}"
    reply = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    assert len(reply.text) < 600


def test_a_lone_surrogate_is_refused_in_words_that_say_so(http):
    body = b'{"model": "tiny", "prompt": "bad \\ud800 text", "max_tokens": 2}'
    reply = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "lone UTF-16 surrogate" in reply.json()["error"]["message"]
    pair = b'{"model": "tiny", "prompt": "ok \\ud83d\\ude00", "max_tokens": 2}'      # a pair is fine
    assert http.post("/v1/completions", content=pair, headers={"content-type": "application/json"}).status_code == 200


def test_an_empty_stop_string_is_refused_as_an_empty_stop_list_is(http):
    for stop in ("", [""]):
        reply = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "stop": stop})
        assert reply.status_code == 400, stop
        assert reply.json()["error"]["param"] == "stop" and "non-empty" in reply.json()["error"]["message"]


def test_engine_refusals_name_their_parameter_for_the_server_to_pass_on(engine):
    with pytest.raises(RequestError) as refused:
        engine.add_request("hi", SamplingParams(top_p=2.0))
    assert refused.value.param == "top_p"
    with pytest.raises(RequestError) as refused:
        engine.add_request([1] * 300, SamplingParams(max_tokens=2))
    assert refused.value.param == "prompt"


def test_the_default_reply_is_what_the_pool_and_max_model_len_leave():
    engine = tiny_engine(num_blocks=8, max_model_len=256)     # 128 pool tokens
    assert engine.max_request_tokens(1) == 8 * 16 + 1 and engine.max_request_tokens(2) == 4 * 16 + 1
    (out,) = engine.generate([[5] * 10], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))
    assert len(out.samples[0].token_ids) == engine.reply_room(10) == 119
    contiguous = tiny_engine(num_blocks=32, max_model_len=256, allocator="contiguous")
    assert contiguous.max_request_tokens(2) == 256 and contiguous.max_request_tokens(3) == 0
    with pytest.raises(RequestError, match="contiguous allocator reserves max_model_len"):
        contiguous.add_request([5] * 10, SamplingParams(n=3, max_tokens=4))


def test_kv_events_on_the_network_are_warned_about_and_loopback_ones_are_not():
    def config(endpoint, replay=None):
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                              replay_endpoint=replay, topic="kv-events")

    for exposed in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://192.168.1.4:5557", "tcp://[::]:5557"):
        assert "token ids" in exposure_warning(config(exposed)), exposed
    assert "tcp://*:5558" in exposure_warning(config("ipc:///tmp/x", "tcp://*:5558"))
    for private in ("ipc:///tmp/events", "tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557"):
        assert exposure_warning(config(private, "tcp://127.0.0.1:5558")) is None, private


def test_a_pool_smaller_than_one_request_is_warned_about_at_start_naming_the_flag():
    small = tiny_engine(num_blocks=8, max_model_len=256)
    warning = pool_warning(small.info)
    assert "128 tokens" in warning and "--max-model-len 128" in warning
    assert pool_warning(tiny_engine().info) is None
