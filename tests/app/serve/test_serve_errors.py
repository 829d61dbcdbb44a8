"""Every bad input gets its HTTP status and an OpenAI-style error body naming what is wrong, and the server goes on
serving: after each refusal the same server answers a good request."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_helpers import SlowSteps, client, running_server, tiny_engine, wait_until

GOOD = {"model": "tiny", "prompt": "Hello there", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as session:
        yield session


def assert_error(response: httpx.Response, status: int, param, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    return error


def still_serving(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("length", "stop")


BAD_COMPLETIONS = {
    "wrong type: temperature": ({"temperature": "hot"}, "temperature", "valid number"),
    "wrong type: a number as a string": ({"max_tokens": "5"}, "max_tokens", "valid integer"),
    "wrong type: n as a float": ({"n": 1.5}, "n", "valid integer"),
    "wrong type: stream": ({"stream": "yes"}, "stream", "valid boolean"),
    "wrong type: prompt": ({"prompt": {"text": "hi"}}, "prompt", ""),
    "out of range: temperature": ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    "out of range: top_p zero": ({"top_p": 0}, "top_p", "greater than 0"),
    "out of range: top_p above one": ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    "out of range: top_k": ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    "out of range: n": ({"n": 0}, "n", "greater than or equal to 1"),
    "out of range: n too big": ({"n": 1000}, "n", "less than or equal to 32"),
    "out of range: max_tokens": ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    "prompt longer than max_model_len": ({"prompt": "word " * 400}, "prompt", "exceeds max_model_len (256)"),
    "prompt plus max_tokens too long": ({"max_tokens": 255}, "prompt", "max_model_len"),
    "empty prompt": ({"prompt": ""}, "prompt", "prompt is empty"),
    "token id outside the vocabulary": ({"prompt": [1, 2, 10**9]}, "prompt", "vocab_size"),
    "out of range: logprobs": ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    "out of range: presence_penalty": ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    "out of range: repetition_penalty": ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    "out of range: min_p": ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    "out of range: logit_bias": ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
    "not a token id: logit_bias": ({"logit_bias": {"five": 1}}, "logit_bias", "not a token id"),
    "outside the vocabulary: logit_bias": ({"logit_bias": {"99999999": 1}}, "logit_bias", "out of the vocabulary"),
    "min_tokens above max_tokens": ({"min_tokens": 5}, "min_tokens", "max_tokens"),
    "wrong type: bad_words": ({"bad_words": "word"}, "bad_words", "valid array"),
    "wrong type: echo": ({"echo": "yes"}, "echo", "valid boolean"),
    "unsupported: best_of": ({"best_of": 3}, "best_of", "use n"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
}


@pytest.mark.parametrize("case", BAD_COMPLETIONS)
def test_bad_completion_requests_are_refused_by_name(http, case):
    fields, param, words = BAD_COMPLETIONS[case]
    assert_error(http.post("/v1/completions", json=GOOD | fields), 400, param, words)
    still_serving(http)


BAD_CHATS = {
    "too many messages": ({"messages": [{"role": "user", "content": "x"}] * 300}, "messages", "too many messages"),
    "no messages": ({"messages": []}, "messages", "at least 1"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "'system'"),
    "content not text": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                         "messages", "text-only"),
    "unsupported: tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
    "unsupported schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}}}, "response_format", "not supported"),
    "unknown response_format": ({"response_format": {"type": "yaml"}}, "response_format.type", "'json_object'"),
    "top_logprobs without logprobs": ({"top_logprobs": 3}, "top_logprobs", "logprobs set to true"),
    "out of range: top_logprobs": ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", "less than or equal"),
    "conversation longer than max_model_len": ({"messages": [{"role": "user", "content": "word " * 400}]},
                                               "messages", "max_model_len"),
}


@pytest.mark.parametrize("case", BAD_CHATS)
def test_bad_chat_requests_are_refused_by_name(http, case):
    fields, param, words = BAD_CHATS[case]
    assert_error(http.post("/v1/chat/completions", json=CHAT | fields), 400, param, words)
    still_serving(http)


@pytest.mark.parametrize("body", [b'{"model": "tiny", "prompt": "hi"', b"not json at all", b""])
def test_malformed_json_is_a_400(http, body):
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, None, "not valid JSON")
    still_serving(http)


def test_a_body_that_is_not_an_object_is_a_400(http):
    assert_error(http.post("/v1/completions", json=[1, 2, 3]), 400, None, "JSON object")
    still_serving(http)


def test_an_unknown_model_is_a_404_in_openai_shape(server, http):
    with pytest.raises(openai.NotFoundError) as caught:
        client(server).completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert caught.value.body["message"] == "The model `gpt-4` does not exist."
    assert_error(http.post("/v1/chat/completions", json=CHAT | {"model": "gpt-4"}), 404, "model", "gpt-4")
    assert_error(http.get("/v1/nothing-here"), 404, None, "Not found")
    still_serving(http)


def test_the_openai_client_sees_the_reason(server):
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=-1)
    assert caught.value.status_code == 400 and caught.value.param == "temperature"
    assert "temperature" in caught.value.message


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    with running_server(max_body_bytes=2048) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        big = GOOD | {"prompt": "x" * 5000}
        assert_error(http.post("/v1/completions", json=big), 413, None, "2,048 bytes")

        def chunks():      # no Content-Length: the bound applies as the body arrives
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert_error(response, 413, None, "larger than this server accepts")
        still_serving(http)


def test_the_api_key_is_required_on_every_v1_route():
    with running_server(api_key="s3cret") as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert_error(http.get("/v1/models"), 401, None, "didn't provide an API key")
        assert_error(http.post("/v1/completions", json=GOOD, headers={"authorization": "Bearer wrong"}), 401,
                     None, "Incorrect API key")
        assert_error(http.post("/v1/chat/completions", json=CHAT), 401, None, "API key")
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="nope").models.list()
        assert client(server, api_key="s3cret").completions.create(model="tiny", prompt="hi", max_tokens=2).choices
        # vLLM's monitoring routes stay open, as vLLM's do
        assert http.get("/metrics").status_code == 200 and http.get("/health").status_code == 200


def test_requests_beyond_the_concurrency_bound_get_a_503_and_the_next_one_is_served():
    engine = tiny_engine()
    engine.add_observer(SlowSteps())
    with running_server(engine, max_concurrent_requests=1) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        slow = GOOD | {"max_tokens": 200, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=slow) as response:
            lines = response.iter_lines()     # kept: a dropped line iterator closes the response
            next(line for line in lines if line.startswith("data:"))
            refused = http.post("/v1/completions", json=GOOD)
            error = assert_error(refused, 503, None, "maximum of 1 requests")
            assert refused.headers["retry-after"] == "1" and error["type"] == "ServiceUnavailableError"
        wait_until(lambda: server.bridge.num_in_flight == 0)
        still_serving(http)


def test_an_infinite_temperature_is_refused_by_the_engines_own_check(http):
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": Infinity}'
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, "temperature", "finite")
    still_serving(http)
