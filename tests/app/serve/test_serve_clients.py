"""What the common clients send, through the official ``openai`` client: log-probabilities (completions, chat,
echo with the prompt's, streamed), the sampling knobs, token-id prompts, /tokenize and /detokenize, unknown
fields ignored with a warning. Log-probabilities equal transformers' fp32 log-softmax of the same weights (the
tiny model is built from a fixed seed, so a second copy is the reference) within 2e-3."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch
from models import tiny_model

TOLERANCE = 2e-3
PROMPT_IDS = [5, 920, 77, 4031, 1200, 18, 342, 9000]


@pytest.fixture(scope="module")
def reference():
    model, tok = tiny_model("llama")
    return model, tok


def log_softmax(model, token_ids) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([list(token_ids)])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_gives_the_prompts_and_the_replys_as_lm_eval_reads_them(api, reference):
    model, tok = reference
    reply = api.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=3, temperature=0,
                                              logprobs=2, echo=True)
    (choice,) = reply.choices
    columns = choice.logprobs
    assert choice.text.startswith(tok.decode(PROMPT_IDS))
    assert len(columns.tokens) == len(columns.token_logprobs) == len(PROMPT_IDS) + 3
    assert columns.token_logprobs[0] is None and columns.top_logprobs[0] is None
    assert columns.tokens[:len(PROMPT_IDS)] == [tok.decode([t]) for t in PROMPT_IDS]
    assert columns.text_offset == sorted(columns.text_offset)
    expected = log_softmax(model, PROMPT_IDS)
    for position in range(1, len(PROMPT_IDS)):
        assert abs(columns.token_logprobs[position] - expected[position - 1, PROMPT_IDS[position]].item()) <= TOLERANCE
        assert 2 <= len(columns.top_logprobs[position]) <= 3
    # The reply's tokens: greedy, so each is the most likely one, and its log-probability the row's maximum.
    for lp, top in zip(columns.token_logprobs[len(PROMPT_IDS):], columns.top_logprobs[len(PROMPT_IDS):]):
        assert abs(lp - max(top.values())) <= 1e-6


def test_completion_logprobs_match_transformers_and_stream_the_same(api, reference):
    model, tok = reference
    openai_client = api
    whole = openai_client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=5, temperature=0,
                                             logprobs=3, extra_body={"prompt_logprobs": 1})
    (choice,) = whole.choices
    pieces = list(openai_client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=5, temperature=0,
                                                   logprobs=3, stream=True))
    streamed = [lp for chunk in pieces for c in chunk.choices if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs and len(streamed) == 5
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT_IDS)
    expected = log_softmax(model, PROMPT_IDS)
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        token = str(PROMPT_IDS[position])
        assert abs(entry[token]["logprob"] - expected[position - 1, PROMPT_IDS[position]].item()) <= TOLERANCE
        assert entry[token]["decoded_token"] == tok.decode([PROMPT_IDS[position]])


def test_chat_logprobs_and_top_logprobs(api, reference):
    model, tok = reference
    reply = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                   extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    assert reply.choices[0].message.content in "".join(entry.token for entry in content)


def test_penalties_and_bias_through_the_client_give_transformers_tokens(api, reference):
    model, tok = reference
    with torch.inference_mode():
        expected = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False, repetition_penalty=1.6,
                                  attention_mask=torch.ones(1, len(PROMPT_IDS), dtype=torch.long),
                                  pad_token_id=tok.pad_token_id)[0, len(PROMPT_IDS):].tolist()
    openai_client = api
    reply = openai_client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                             logprobs=0, extra_body={"repetition_penalty": 1.6, "ignore_eos": True})
    assert reply.choices[0].logprobs.tokens == [tok.decode([t]) for t in expected]
    biased = openai_client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=3, temperature=0,
                                              logit_bias={"1234": 100}, presence_penalty=0.5, frequency_penalty=0.5,
                                              extra_body={"min_p": 0.1, "min_tokens": 3, "bad_words": ["zz"]})
    assert biased.choices[0].text == tok.decode([1234] * 3)


def test_token_id_prompts_one_or_a_batch(api):
    openai_client = api
    second = [7, 8, 9, 10]
    batch = openai_client.completions.create(model="tiny", prompt=[PROMPT_IDS, second], max_tokens=3, temperature=0)
    alone = [openai_client.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0).choices[0].text
             for p in (PROMPT_IDS, second)]
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone
    assert batch.usage.prompt_tokens == len(PROMPT_IDS) + len(second)


def test_tokenize_and_detokenize_in_vllms_shapes(server, reference):
    _, tok = reference
    with httpx.Client(base_url=server.url, timeout=30) as http:
        text = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello there, world", "return_token_strs": True})
        assert text.status_code == 200, text.text
        body = text.json()
        assert body["tokens"] == tok.encode("Hello there, world") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 256 and body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["tokens"] == server.engine.prompt_token_ids([{"role": "user", "content": "Hi"}])
        back = http.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]})
        assert back.json() == {"prompt": "Hello there, world"}
        refused = http.post("/detokenize", json={"tokens": [10**8]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"


def test_unknown_fields_are_ignored_with_one_warning_naming_them(api, caplog):
    with caplog.at_level(logging.WARNING, logger="kvscope.serve"):
        reply = api.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                                  extra_body={"custom_field": 1, "another_one": {"x": 2}})
    assert reply.choices[0].finish_reason in ("length", "stop")
    warnings = [r.getMessage() for r in caplog.records if "unknown fields" in r.getMessage()]
    assert warnings == ["/v1/completions: ignored the request's unknown fields: another_one, custom_field"]


def test_streamed_chat_logprobs_and_streamed_echo_are_the_whole_bodys(api):
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = api.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [entry for chunk in api.chat.completions.create(**chat, stream=True) for choice in chunk.choices
                if choice.logprobs for entry in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]
    echo = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=3, temperature=0, logprobs=1, echo=True)
    body = api.completions.create(**echo).choices[0]
    chunks = [c for chunk in api.completions.create(**echo, stream=True) for c in chunk.choices]
    assert "".join(c.text for c in chunks) == body.text
    assert [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs] == body.logprobs.token_logprobs
