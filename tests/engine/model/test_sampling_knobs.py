"""The sampling knobs and log-probabilities, against transformers on the same weights.

Greedy decoding with a repetition penalty gives transformers' own ``generate(..., repetition_penalty=...)`` tokens
(on the default model with a real chat prompt, and on a tiny model beside plain rows, chunked and preempted);
OpenAI's presence and frequency penalties, logit_bias, min_tokens and bad_words give what a step-by-step
reference over transformers' logits gives. Log-probabilities (sampled and prompt) equal transformers' fp32
log-softmax within 2e-3. Rows without knobs keep their tokens, and the penalty tables give their rows back.
"""

from __future__ import annotations

import gc

import pytest
import torch
from invariants import run_checked
from models import load_smollm2, tiny_model

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.config import RequestError

TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def smollm2():
    """The reference model: the engine patches the model it is given, so each engine gets a fresh one."""
    return load_smollm2()


def smollm2_engine(**overrides) -> LLMEngine:
    return engine_for(*load_smollm2(), **overrides)


def engine_for(model, tok, **overrides) -> LLMEngine:
    settings = dict(dtype="float32", block_size=16, num_blocks=128, max_model_len=512)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), model=model, tokenizer=tok)


def run(engine: LLMEngine, prompts, params) -> list:
    """generate() with the pool's invariants checked after every step, and nothing held at the end."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    finals = {output.request_id: output for output in run_checked(engine) if output.finished}
    return [finals[i] for i in ids]


def greedy(tokens: int, **knobs) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **knobs)


def chat(tok, text: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"])


def hf_generate(model, tok, prompt, tokens, **options) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, **options)
    return out[0, len(prompt):].tolist()


def hf_log_softmax(model, token_ids) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([list(token_ids)])).logits[0].float(), dim=-1)


def test_greedy_with_a_repetition_penalty_is_transformers_generate_on_the_default_model(smollm2):
    model, tok = smollm2
    prompt = chat(tok, "List five fruits, then list them again.")
    expected = hf_generate(model, tok, prompt, 32, repetition_penalty=1.3)
    unpenalized = hf_generate(model, tok, prompt, 32)
    assert expected != unpenalized, "the penalty must change this answer to test anything"
    penalized, plain = run(smollm2_engine(), [prompt, prompt], [greedy(32, repetition_penalty=1.3), greedy(32)])
    assert list(penalized.token_ids) == expected
    assert list(plain.token_ids) == unpenalized


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 24},
                                       {"num_blocks": 10, "preemption_mode": "recompute"}])
def test_repetition_penalty_on_a_tiny_model_holds_chunked_and_preempted(overrides):
    model, tok = tiny_model(seed=3)
    prompts = [[(7 * i + 13 * j) % 3000 + 100 for j in range(20 + 9 * i)] for i in range(5)]
    params = [greedy(30, repetition_penalty=penalty) for penalty in (1.5, 0.7, 1.0, 2.0, 1.2)]
    expected = [hf_generate(model, tok, prompt, 30, repetition_penalty=p.repetition_penalty)
                for prompt, p in zip(prompts, params)]
    finals = run(engine_for(*tiny_model(seed=3), **overrides), prompts, params)
    assert [list(output.token_ids) for output in finals] == expected


def reference_decode(model, prompt, tokens, adjust) -> list[int]:
    """Greedy, one token a step over transformers' logits, with ``adjust(logits, output so far)`` applied."""
    output: list[int] = []
    for _ in range(tokens):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        output.append(int(adjust(logits.clone(), output).argmax()))
    return output


def openai_penalties(presence: float, frequency: float):
    def adjust(logits, output):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[0]).float() \
            if output else torch.zeros_like(logits)
        return logits - frequency * counts - presence * (counts > 0).float()
    return adjust


def test_presence_and_frequency_penalties_are_openais():
    model, tok = tiny_model(seed=5)
    prompt = [(11 * j) % 2000 + 50 for j in range(30)]
    cases = [(0.0, 1.5), (1.8, 0.0), (-1.0, 0.5), (0.5, 0.5)]
    expected = [reference_decode(model, prompt, 24, openai_penalties(*case)) for case in cases]
    finals = run(engine_for(*tiny_model(seed=5)), [prompt] * len(cases),
                 [greedy(24, presence_penalty=p, frequency_penalty=f) for p, f in cases])
    assert [list(output.token_ids) for output in finals] == expected


def test_logit_bias_min_tokens_and_bad_words(smollm2):
    model, tok = smollm2
    prompt = chat(tok, "What is the capital of France?")
    plain = hf_generate(model, tok, prompt, 12)
    engine = smollm2_engine()
    word = tok.decode(plain[2]).strip()
    eos = tok.eos_token_id
    forced, banned, early_stop, bad = run(engine, [prompt] * 4, [
        greedy(6, logit_bias={1234: 100}),
        greedy(12, logit_bias={plain[0]: -100}),
        SamplingParams(max_tokens=12, temperature=0.0, logit_bias={eos: 100}, min_tokens=5),
        greedy(12, bad_words=[word])])
    assert list(forced.token_ids) == [1234] * 6
    assert banned.token_ids[0] != plain[0]
    assert list(early_stop.token_ids[:5]) == [t for t in early_stop.token_ids[:5] if t != eos]
    assert early_stop.token_ids[5] == eos and len(early_stop.token_ids) == 6 and early_stop.finish_reason == "stop"
    assert list(bad.token_ids[:2]) == plain[:2] and bad.token_ids[2] != plain[2]
    assert word not in bad.text


def test_logprobs_are_transformers_log_softmax(smollm2):
    """Sampled tokens' log-probabilities, rank and top-N, and the prompt's (prefilled in chunks of 24, so a chunk's
    last position waits for the next chunk's first token), within 2e-3 of transformers' fp32 log-softmax."""
    model, tok = smollm2
    prompt = chat(tok, "Name three colours of the rainbow.")
    engine = smollm2_engine(max_num_batched_tokens=24)
    (output,) = run(engine, [prompt], [SamplingParams(max_tokens=10, temperature=0.8, seed=7, logprobs=5,
                                                       prompt_logprobs=3, ignore_eos=True)])
    expected = hf_log_softmax(model, prompt + list(output.token_ids))
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        row = expected[position - 1]
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - row[prompt[position]].item()) <= TOLERANCE
        assert entry.rank == int((row > row[prompt[position]]).sum()) + 1 or abs(entry.logprob - row.max()) < TOLERANCE
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    logprobs = output.samples[0].logprobs
    assert len(logprobs) == len(output.token_ids) == 10
    for step, (token, entry) in enumerate(zip(output.token_ids, logprobs)):
        row = expected[len(prompt) - 1 + step]
        assert entry.token_id == token and abs(entry.logprob - row[token].item()) <= TOLERANCE
        assert len(entry.top) == 5 and all(abs(lp - row[t].item()) <= TOLERANCE for t, lp in entry.top)


def test_prompt_logprobs_skip_the_prefix_cache_so_every_position_has_one(smollm2):
    model, tok = smollm2
    prompt = chat(tok, "Why is the sky blue? Explain in one sentence, please.")
    engine = smollm2_engine()
    run(engine, [prompt], [greedy(2)])      # the prompt's blocks are now cached
    (again,) = run(engine, [prompt], [greedy(2, prompt_logprobs=0)])
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(prompt)
    (plain,) = run(engine, [prompt], [greedy(2)])
    assert plain.num_cached_tokens > 0


def test_rows_without_knobs_keep_their_tokens_and_penalty_rows_come_back():
    prompts = [[(5 * i + 3 * j) % 4000 + 100 for j in range(12 + i)] for i in range(6)]
    engine = engine_for(*tiny_model(seed=1))
    alone = run(engine, prompts, [greedy(16)] * 6)
    mixed = run(engine, prompts, [greedy(16, frequency_penalty=1.0) if i % 2 else greedy(16) for i in range(6)])
    for i in range(0, 6, 2):
        assert mixed[i].token_ids == alone[i].token_ids
    engine.step()       # the last batch's items let go of their requests
    gc.collect()
    assert engine.runner.sampler.processor.rows_in_use == 0


@pytest.mark.parametrize("knob, value", [
    ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("min_p", 1.5), ("min_tokens", -1), ("min_tokens", 99), ("logit_bias", {"x": 1}),
    ("logit_bias", {5: 101}), ("logit_bias", {10**7: 1}), ("bad_words", [""]), ("logprobs", 21),
    ("prompt_logprobs", -1)])
def test_a_bad_knob_is_refused_by_name_and_the_engine_goes_on(knob, value):
    engine = engine_for(*tiny_model())
    with pytest.raises(RequestError) as refused:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, **{knob: value}))
    assert refused.value.param == knob and knob in str(refused.value)
    (output,) = run(engine, [[1, 2, 3]], [greedy(4)])
    assert len(output.token_ids) == 4


def test_every_sample_of_n_has_its_own_penalty_counts():
    """n > 1: the samples fork from one prompt row, then each is penalised by its own output only; greedy samples
    therefore agree with each other and with a single request's answer, and sampled ones (seeded) reproduce."""
    prompt = [(13 * j) % 2500 + 70 for j in range(25)]
    knobs = dict(frequency_penalty=1.2, repetition_penalty=1.3)
    engine = engine_for(*tiny_model(seed=2))
    (single,) = run(engine, [prompt], [greedy(16, **knobs)])
    (forked,) = run(engine, [prompt], [greedy(16, n=3, **knobs)])
    assert all(sample.token_ids == single.token_ids for sample in forked.samples)
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=11, n=3, ignore_eos=True, **knobs)
    first, again = run(engine, [prompt, prompt], [sampled, sampled])
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in again.samples]
