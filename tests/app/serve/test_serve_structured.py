"""Structured output through the official client on the default model: every constrained answer parses, and
validates against its schema (pydantic), greedy or sampled, streamed or not; ``client.beta.chat.completions.parse``
gets its pydantic object back; a schema the grammar engine cannot honour is a 400 naming response_format."""

from __future__ import annotations

import json

import openai
import pytest
from models import load_smollm2
from pydantic import BaseModel, ConfigDict, Field
from serve_helpers import running_server

from kvscope.app.widgets.queue_rows import row_cells
from kvscope.engine import EngineConfig, LLMEngine, SamplingParams


class City(BaseModel):
    name: str
    country: str
    population: int
    is_capital: bool


class ShortCity(BaseModel):
    """Bounded, so that a sampled answer (which may ramble inside a string) ends within max_tokens."""

    model_config = ConfigDict(extra="forbid")   # additionalProperties: false, as OpenAI's strict schemas say
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)
    is_capital: bool


@pytest.fixture(scope="module")
def server():
    model, tok = load_smollm2()
    engine = LLMEngine(EngineConfig(dtype="float32", num_blocks=256, max_model_len=1024), model=model, tokenizer=tok)
    with running_server(engine) as running:
        yield running


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model_gives_the_object(api):
    reply = api.beta.chat.completions.parse(
        model="tiny", messages=ask("Describe Paris as JSON: name, country, population, is_capital."),
        response_format=City, max_tokens=80, temperature=0)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


def test_every_sampled_answer_validates_against_its_schema(api):
    reply = api.chat.completions.create(
        model="tiny", messages=ask("Give me a city as JSON."), n=4, temperature=1.0, seed=3, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "city",
                                                                 "schema": ShortCity.model_json_schema()}})
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        ShortCity.model_validate_json(choice.message.content)


def test_json_object_streamed_parses(api):
    chunks = api.chat.completions.create(
        model="tiny", messages=ask("List three colours in a JSON object."), max_tokens=80, temperature=0,
        response_format={"type": "json_object"}, stream=True)
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert isinstance(json.loads(text), dict)


def test_an_unsupported_schema_is_a_400_and_the_server_goes_on(api):
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(
            model="tiny", messages=ask("Hi"), max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}})
    assert refused.value.param == "response_format" and "not supported" in refused.value.message
    reply = api.chat.completions.create(model="tiny", messages=ask("Hi"), max_tokens=3)
    assert reply.choices[0].message.content is not None


def test_the_window_shows_a_constrained_request_as_such(server):
    """The queues' row of a constrained request starts with its format, e.g. "{json schema}"."""
    engine = server.engine
    engine.add_request([{"role": "user", "content": "Hi"}], SamplingParams(
        max_tokens=2, structured_output=("json_schema", ShortCity.model_json_schema())), request_id="constrained")
    engine.add_request("Hello", SamplingParams(max_tokens=2), request_id="plain")
    views = {view.request_id: view for view in engine.snapshot().requests}
    assert any(cell.startswith("{json schema} ") for cell in row_cells(views["constrained"]))
    assert not any(cell.startswith("{") for cell in row_cells(views["plain"]))
