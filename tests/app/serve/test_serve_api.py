"""kvscope serve through the official `openai` client, as users drive it: completions and chat, streaming and
not, n, stop, seed, max_tokens and usage (cached tokens included), and a client that disconnects mid-stream."""

from __future__ import annotations

import httpx
import openai
import pytest
from invariants import check_invariants
from serve_helpers import SlowSteps, client, running_server, tiny_engine, wait_until

from kvscope.engine import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog because"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


def streamed_text(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str], list]:
    texts, reasons, usages = {}, {}, []
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usages


def test_models_lists_the_served_model(api, server):
    (card,) = api.models.list().data
    assert card.id == "tiny" and card.owned_by == "kvscope"
    assert card.model_extra["max_model_len"] == 256


def test_completion_matches_the_engine_and_streaming_gives_the_same_text(api, server):
    whole = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    streamed = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    texts, reasons, usages = streamed_text(streamed, chat=False)
    assert sum(1 for chunk in streamed if chunk.choices) == 12     # a chunk per token, as vLLM streams
    engine = tiny_engine()      # the same weights (seeded), outside the server
    (expected,) = engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))
    assert whole.choices[0].text == expected.text == texts[0]
    assert whole.choices[0].finish_reason == reasons[0] == "length"
    (usage,) = usages
    assert usage.completion_tokens == whole.usage.completion_tokens == 12
    assert usage.prompt_tokens == whole.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_chat_streaming_and_not_agree(api):
    whole = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
    stream = api.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0, stream=True)
    texts, reasons, _ = streamed_text(stream, chat=True)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == texts[0] and texts[0]
    assert whole.choices[0].finish_reason == reasons[0] == "length"
    assert whole.usage.completion_tokens == 10


def test_n_samples_are_separate_choices_and_a_seed_repeats_them(api):
    first = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7)
    again = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1     # three different samples, not one copied
    assert first.usage.completion_tokens == 24
    stream = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7,
                                    stream=True)
    texts, _, _ = streamed_text(stream, chat=False)
    assert [texts[i] for i in range(3)] == [c.text for c in first.choices]


def test_top_k_one_and_a_tiny_top_p_sample_the_greedy_token(api):
    greedy = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    top_k = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3,
                                   extra_body={"top_k": 1}).choices[0].text
    top_p = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3,
                                   top_p=1e-6).choices[0].text
    assert greedy == top_k == top_p


def test_stop_string_cuts_the_text_and_says_stop(api):
    free = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    cut = free[3:6]
    assert cut.strip(), f"the tiny model's text has no usable stop string: {free!r}"
    stopped = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free[:free.index(cut)]


def test_a_batch_of_prompts_gets_one_choice_each(api):
    batch = api.completions.create(model="tiny", prompt=[PROMPT, "Once upon a time"], max_tokens=5, temperature=0)
    single = api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text == single.choices[0].text


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(api):
    long_prompt = " ".join(f"word{i}" for i in range(40))   # several full blocks of 16 tokens
    cold = api.completions.create(model="tiny", prompt=long_prompt, max_tokens=2, temperature=0)
    warm = api.completions.create(model="tiny", prompt=long_prompt, max_tokens=2, temperature=0)
    details = warm.usage.prompt_tokens_details
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert details.cached_tokens == (warm.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_the_default_max_tokens_is_sixteen_for_completions(api):
    reply = api.completions.create(model="tiny", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16


def test_a_client_that_disconnects_mid_stream_frees_its_blocks():
    engine = tiny_engine()
    engine.add_observer(SlowSteps())    # 200 tokens take seconds: the client leaves long before the end
    with running_server(engine) as server:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                assert engine.snapshot().requests, "the request should be running"
        # The connection is closed: the server aborts the request at once and frees its blocks.
        wait_until(lambda: not engine.has_unfinished_requests())
        snapshot = engine.snapshot()
        assert snapshot.requests == ()
        assert (snapshot.ref_counts == 0).all()
        check_invariants(engine)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 1.0' in metrics
        # and the server goes on serving
        assert client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=3).choices[0].text


def test_a_client_that_gives_up_on_a_whole_reply_frees_its_blocks():
    engine = tiny_engine()
    engine.add_observer(SlowSteps())
    with running_server(engine) as server:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        wait_until(lambda: not engine.has_unfinished_requests())
        assert (engine.snapshot().ref_counts == 0).all()
        assert engine.step_counter < 150, "the request should have been aborted, not run to its end"
        check_invariants(engine)


def test_a_failed_engine_step_is_a_500_for_its_requests_and_the_server_goes_on():
    engine = tiny_engine()
    execute = engine.runner.execute
    failures = []

    def fail_once(batch):
        if not failures:
            failures.append(batch)
            raise RuntimeError("injected: the forward failed")
        return execute(batch)

    engine.runner.execute = fail_once
    with running_server(engine) as server:
        api = client(server)
        with pytest.raises(openai.InternalServerError) as caught:
            api.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert "The engine failed this request" in caught.value.message and "injected" in caught.value.message
        assert api.completions.create(model="tiny", prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4
        check_invariants(engine)


def test_a_new_request_joins_a_busy_engine_within_a_step_or_two():
    """Engine calls run between steps: a request is not kept waiting behind a stepping thread that takes the
    engine's lock again the moment it lets it go (counted in steps, not seconds)."""
    engine = tiny_engine()
    with running_server(engine) as server, client(server) as api:
        waited = []
        submit = server.bridge._submit

        def counted(function, *args):
            submitted = engine.step_counter
            future = submit(function, *args)
            future.add_done_callback(lambda _: waited.append(engine.step_counter - submitted))
            return future

        server.bridge._submit = counted
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as busy:
            lines = busy.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            for _ in range(5):
                assert api.completions.create(model="tiny", prompt="Hello", max_tokens=1).usage.completion_tokens
            still_busy = engine.has_unfinished_requests()
        assert still_busy, "the busy request should outlast the five others"
        assert max(waited[1:6]) <= 2, f"requests waited {waited[1:6]} steps to be added"
