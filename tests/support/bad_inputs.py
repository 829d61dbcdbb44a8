"""Inputs add_request must refuse with RequestError, changing nothing, by category.

Shared by the parametrized tests (tests/test_engine_input.py) and the stateful fault test
(tests/test_engine_faults.py). Each case is (prompt, params, request_id, what the message says). They
are written for a FakeRunner engine: vocabulary 259, byte tokenizer, max_model_len 128.
"""

from __future__ import annotations

from kvscope.engine import SamplingParams

GOOD_PROMPT = [1, 2, 3]


def params(**fields) -> SamplingParams:
    """SamplingParams with fields set after construction, as a caller mutating one would."""
    sampling = SamplingParams(max_tokens=4)
    for name, value in fields.items():
        setattr(sampling, name, value)
    return sampling


BAD_INPUTS: dict[str, list[tuple]] = {
    "token-id prompt": [
        ([-1], None, None, "vocab_size"),
        ([10**12], None, None, "vocab_size"),
        ([2**63], None, None, "vocab_size"),
        ([1, 2, 259], None, None, "vocab_size"),
        ([1, 2.0], None, None, "prompt must be"),
        ([True, 1], None, None, "prompt must be"),
        ([1, None], None, None, "prompt must be"),
        ([], None, None, "prompt is empty"),
        ("", None, None, "prompt is empty"),
        (42, None, None, "prompt must be"),
        (None, None, None, "prompt must be"),
        ([1] * 200, None, None, "max_model_len"),
    ],
    "chat messages": [
        ([{"role": "user", "content": None}], None, None, "'content'"),
        ([{"role": "user", "content": 42}], None, None, "'content'"),
        ([{"role": "user", "content": ["hi"]}], None, None, "'content'"),
        ([{"role": "user"}], None, None, "'content'"),
        ([{"content": "hi"}], None, None, "'role'"),
        ([{"role": None, "content": "hi"}], None, None, "'role'"),
        ([{"role": "user", "content": "hi"}, "not a message"], None, None, "prompt must be"),
    ],
    "sampling params": [
        (GOOD_PROMPT, params(seed="x"), None, "seed"),
        (GOOD_PROMPT, params(seed=1.5), None, "seed"),
        (GOOD_PROMPT, params(seed=True), None, "seed"),
        (GOOD_PROMPT, params(temperature=None), None, "temperature"),
        (GOOD_PROMPT, params(temperature="0.5"), None, "temperature"),
        (GOOD_PROMPT, params(temperature=float("nan")), None, "temperature"),
        (GOOD_PROMPT, params(temperature=float("inf")), None, "temperature"),
        (GOOD_PROMPT, params(temperature=-0.5), None, "temperature"),
        (GOOD_PROMPT, params(top_p=None), None, "top_p"),
        (GOOD_PROMPT, params(top_p="1"), None, "top_p"),
        (GOOD_PROMPT, params(top_p=0.0), None, "top_p"),
        (GOOD_PROMPT, params(top_p=1.5), None, "top_p"),
        (GOOD_PROMPT, params(top_k=None), None, "top_k"),
        (GOOD_PROMPT, params(top_k="5"), None, "top_k"),
        (GOOD_PROMPT, params(top_k=2.5), None, "top_k"),
        (GOOD_PROMPT, params(top_k=-2), None, "top_k"),
        (GOOD_PROMPT, params(stop=5), None, "stop"),
        (GOOD_PROMPT, params(stop=[1, 2]), None, "stop"),
        (GOOD_PROMPT, params(stop=[""]), None, "non-empty"),
        (GOOD_PROMPT, params(stop=["x"], detokenize=False), None, "detokenize"),
        (GOOD_PROMPT, params(stop_token_ids=5), None, "stop_token_ids"),
        (GOOD_PROMPT, params(stop_token_ids=["a"]), None, "stop_token_ids"),
        (GOOD_PROMPT, params(stop_token_ids=[1.5]), None, "stop_token_ids"),
        (GOOD_PROMPT, params(stop_token_ids=[-1]), None, "stop_token_ids"),
        (GOOD_PROMPT, params(max_tokens=True), None, "max_tokens"),
        (GOOD_PROMPT, params(max_tokens=0), None, "max_tokens"),
        (GOOD_PROMPT, params(max_tokens=4.0), None, "max_tokens"),
        (GOOD_PROMPT, params(n=True), None, "n must"),
        (GOOD_PROMPT, params(n=0), None, "n must"),
        (GOOD_PROMPT, params(n="2"), None, "n must"),
        (GOOD_PROMPT, params(ignore_eos=1), None, "ignore_eos"),
        (GOOD_PROMPT, params(detokenize="no"), None, "detokenize"),
        (GOOD_PROMPT, params(max_tokens=30, n=4), None, "num_blocks"),
        (GOOD_PROMPT, {"max_tokens": 4}, None, "must be a SamplingParams"),
        (GOOD_PROMPT, "greedy", None, "must be a SamplingParams"),
    ],
    "request id": [
        (GOOD_PROMPT, None, 7, "request_id"),
        (GOOD_PROMPT, None, b"id", "request_id"),
        (GOOD_PROMPT, None, "", "request_id"),
        (GOOD_PROMPT, None, ("a",), "request_id"),
    ],
}


def all_cases() -> list[tuple[str, tuple]]:
    return [(category, case) for category, cases in BAD_INPUTS.items() for case in cases]
