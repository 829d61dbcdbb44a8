import math

import torch

from kvscope.engine.config import SamplingParams
from kvscope.engine.model.sampler import Sampler, SampleRow


def rows(params, count=1, position=10):
    return [SampleRow(params, i, position) for i in range(count)]


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert Sampler(0).sample(logits, rows(SamplingParams(temperature=0.0), 2)) == [1, 0]


def test_nan_row_fails_alone():
    logits = torch.tensor([[0.1, float("nan"), 0.2], [5.0, 1.0, 0.0]])
    assert Sampler(0).sample(logits, rows(SamplingParams(temperature=0.0), 2)) == [None, 0]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        assert Sampler(0).sample(logits, rows(params, 8)) == expected


def test_top_k_never_leaves_the_k_best():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2))
    best = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(0)
    drawn = {sampler.sample(logits, rows(SamplingParams(temperature=2.0, top_k=3)))[0] for _ in range(200)}
    assert drawn <= best and len(drawn) == 3


def test_seed_makes_draws_reproducible_and_position_dependent():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=42)
    first = [Sampler(0).sample(logits, rows(params, position=p))[0] for p in range(20)]
    again = [Sampler(123).sample(logits, rows(params, position=p))[0] for p in range(20)]
    assert first == again
    assert len(set(first)) > 10


def test_samples_of_one_request_differ_by_index():
    logits = torch.zeros(4, 1000)
    tokens = Sampler(0).sample(logits, rows(SamplingParams(temperature=1.0, seed=7), 4))
    assert len(set(tokens)) == 4


def test_temperature_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    tokens = Sampler(3).sample(logits, rows(SamplingParams(temperature=1.0), 4000))
    share = tokens.count(0) / len(tokens)
    assert math.isclose(share, 0.7, abs_tol=0.04)
