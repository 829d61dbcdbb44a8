import dataclasses
import math

import pytest
import torch

from kvscope.engine.config import SamplingParams
from kvscope.engine.model import sampler as sampler_module
from kvscope.engine.model.sampler import Sampler, SampleRow
from kvscope.kernels import cpu as cpu_kernels


@pytest.fixture(autouse=True, params=["fused", "tensors"])
def random_path(request, monkeypatch):
    """Every test runs on both random-row paths: the C++ kernel (sampler_cpu.cpp) and the tensor ops that any
    device takes."""
    if request.param == "fused" and not cpu_kernels.available():
        pytest.skip(f"C++ kernels unavailable: {cpu_kernels.status()}")
    if request.param == "tensors":
        monkeypatch.setattr(sampler_module.cpu_kernels, "available", lambda: False)
    return request.param


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


def drawn_shares(logits_row, params, draws=6000):
    """Token frequencies over ``draws`` seeded rows of one logit vector, all in one batch."""
    logits = logits_row.unsqueeze(0).repeat(draws, 1)
    rows = [SampleRow(dataclasses.replace(params, seed=seed), 0, 5) for seed in range(draws)]
    tokens = torch.tensor(Sampler(0).sample(logits, rows))
    return torch.bincount(tokens, minlength=logits.shape[1]).double() / draws


def test_seeded_rows_draw_the_same_batched_and_alone():
    vocab = 3000   # more than one chunk, with a partial last chunk
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(4)) * 3
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.95),
             SamplingParams(temperature=1.3, top_k=40), SamplingParams(temperature=1.0),
             SamplingParams(temperature=0.5, top_k=200, top_p=0.5), SamplingParams(temperature=2.0, top_p=1e-3)]
    batch = [SampleRow(dataclasses.replace(kinds[i % len(kinds)], seed=100 + i), i % 2, 40 + i) for i in range(12)]
    together = Sampler(0).sample(logits, batch)
    alone = [Sampler(99).sample(logits[i:i + 1], [row])[0] for i, row in enumerate(batch)]
    assert together == alone
    assert together[0] == int(logits[0].argmax())


def test_greedy_takes_the_first_maximum_across_chunks_and_finds_nan_in_the_last():
    logits = torch.zeros(2, 2500)
    logits[0, [1500, 2100]] = 4.0
    logits[1, 2400] = float("nan")
    assert Sampler(0).sample(logits, rows(SamplingParams(temperature=0.0), 2)) == [1500, None]


def test_temperature_top_k_and_top_p_follow_their_distributions():
    logits_row = torch.randn(2500, generator=torch.Generator().manual_seed(5)) * 2
    logits_row[:6] = torch.tensor([6.0, 5.5, 5.0, 4.0, 3.5, 3.0])
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=4),
                   SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.5, top_p=0.3)):
        expected = reference_distribution(logits_row, params)
        shares = drawn_shares(logits_row, params)
        assert (shares[expected == 0] == 0).all(), params
        assert (shares - expected).abs().max() < 0.025, params


def reference_distribution(logits_row, params):
    """Temperature, top-k and top-p by the book: one full sort."""
    probs = (logits_row.double() / params.temperature).softmax(-1)
    values, order = probs.sort(descending=True)
    if params.top_k > 0:
        values[params.top_k:] = 0
    values = values / values.sum()
    values[values.cumsum(0) - values >= params.top_p] = 0
    out = torch.zeros_like(probs)
    out[order] = values / values.sum()
    return out


def test_a_flat_row_with_a_tiny_top_p_settles_by_sorting_its_own_row():
    # Every draw in a flat row is rejected until the nucleus is found: the rounds run out and the row sorts.
    logits = torch.linspace(0.0, 1e-3, 2000).unsqueeze(0).repeat(64, 1)
    tokens = Sampler(0).sample(logits, rows(SamplingParams(temperature=1.0, top_p=1e-4, seed=1), 64))
    assert set(tokens) == {1999}


@dataclasses.dataclass
class WithMinP(SamplingParams):
    min_p: float = 0.0


def test_min_p_cuts_what_lies_under_its_share_of_the_best():
    logits_row = torch.tensor([2.0, 1.0, 0.0, -3.0] + [-9.0] * 1200)
    shares = drawn_shares(logits_row, WithMinP(temperature=1.0, min_p=0.3))
    assert shares[0] > 0.6 and shares[1] > 0.2 and shares[2:].sum() == 0


def test_tied_tokens_enter_the_nucleus_together():
    # The nucleus is every token whose mass strictly above is under top_p: four tied best tokens (a fifth of
    # the mass each) all pass at top_p=0.3, though two of them already reach it.
    logits_row = torch.tensor([2.0] * 4 + [-9.0] * 1500)
    logits_row[4:] = math.log(0.2 / 1500) + 2.0 - math.log(0.2)
    shares = drawn_shares(logits_row, SamplingParams(temperature=1.0, top_p=0.3))
    assert shares[4:].sum() == 0
    assert (shares[:4] - 0.25).abs().max() < 0.03


def test_a_mixed_batch_splits_between_the_paths_and_each_row_keeps_its_draw():
    # Rows with top-k take the tensor ops, the others the kernel; a row's token must not depend on that split.
    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(7)) * 2
    kinds = [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=1.1, top_k=50),
             WithMinP(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.0)]
    batch = [SampleRow(dataclasses.replace(kinds[i % 4], seed=7 + i), 0, 3) for i in range(8)]
    together = Sampler(0).sample(logits, batch)
    assert together == [Sampler(1).sample(logits[i:i + 1], [row])[0] for i, row in enumerate(batch)]
    assert all(token is not None for token in together)


def test_a_nan_row_gives_no_token_and_spares_the_others():
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(8))
    logits[1, 999] = float("nan")
    tokens = Sampler(0).sample(logits, rows(SamplingParams(temperature=0.8, top_p=0.9, seed=3), 3))
    assert tokens[1] is None and tokens[0] is not None and tokens[2] is not None


def test_the_kernel_draws_what_the_tensor_ops_draw_for_the_same_uniforms(random_path, monkeypatch):
    if random_path == "tensors":
        pytest.skip("compares the kernel with the tensor ops")
    # The same algorithm and uniforms: only the exponential's last bits differ, so nearly every token agrees.
    logits = torch.randn(400, 5000, generator=torch.Generator().manual_seed(9)) * 2.5
    batch = [SampleRow(SamplingParams(temperature=0.7, top_p=0.95, seed=i), 0, 11) for i in range(400)]
    fused = Sampler(0).sample(logits, batch)
    monkeypatch.setattr(sampler_module.cpu_kernels, "available", lambda: False)
    tensors = Sampler(0).sample(logits, batch)
    assert sum(a == b for a, b in zip(fused, tensors)) >= 396
