"""The torch reference kernels (the CPU path) against a naive float64 oracle, on random paged layouts.

Every slot no sequence owns holds NaN (see ``kernels.testing.random_layout``), so reading past a context, or
through a padding column of a block table, cannot go unnoticed.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import reference
from kernels.testing import naive_attention, random_layout

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
GROUPS = st.sampled_from([1, 3, 4])
HEAD_DIMS = st.sampled_from([64, 128])
BLOCK_SIZES = st.sampled_from([8, 16, 32])
FAST = settings(max_examples=25, deadline=None, derandomize=True, database=None)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert not torch.isnan(out).any(), "NaN in kernel output"
    error = (out.double() - expected).abs().max().item()
    assert error < TOLERANCE[dtype], f"max abs error {error}"


def make_query(num_tokens: int, num_q_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    # Built head-major then transposed: the kernels must not assume a contiguous query.
    return torch.randn(num_q_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)


@FAST
@given(
    dtype=DTYPES, group=GROUPS, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES,
    num_kv_heads=st.integers(1, 2), context_lens=st.lists(st.integers(1, 150), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_decode_matches_naive(dtype, group, head_dim, block_size, num_kv_heads, context_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    layout = random_layout(context_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query = make_query(len(context_lens), num_kv_heads * group, head_dim, dtype, gen)
    scale = head_dim ** -0.5

    out = reference.paged_decode_attention(
        query, layout.kv_layer, layout.block_tables, layout.context_lens, scale
    )

    last_positions = [torch.tensor([length - 1]) for length in context_lens]
    assert_matches(out, naive_attention(query, layout, last_positions, scale), dtype)


@FAST
@given(
    dtype=DTYPES, group=GROUPS, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES,
    chunks=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 40)), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_prefill_matches_naive(dtype, group, head_dim, block_size, chunks, seed):
    """``chunks`` are (tokens already cached before this chunk, chunk length) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [prefix + length for prefix, length in chunks]
    layout = random_layout(context_lens, block_size, 1, head_dim, dtype, gen)
    query_lens = [length for _, length in chunks]
    query = make_query(sum(query_lens), group, head_dim, dtype, gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim ** -0.5

    out = reference.paged_prefill_attention(
        query, layout.kv_layer, layout.block_tables, cu_seqlens, layout.context_lens, scale
    )

    positions = [torch.arange(prefix, prefix + length) for prefix, length in chunks]
    assert_matches(out, naive_attention(query, layout, positions, scale), dtype)


@pytest.mark.parametrize("block_size", [1, 4, 128])
def test_decode_and_prefill_at_extreme_block_sizes(block_size):
    gen = torch.Generator().manual_seed(block_size)
    context_lens = [1, 37, 130]
    layout = random_layout(context_lens, block_size, 2, 64, torch.float32, gen)
    query = make_query(3, 6, 64, torch.float32, gen)
    decode = reference.paged_decode_attention(
        query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.1
    )
    last_positions = [torch.tensor([length - 1]) for length in context_lens]
    assert_matches(decode, naive_attention(query, layout, last_positions, 0.1), torch.float32)

    chunk = make_query(1 + 5 + 130, 6, 64, torch.float32, gen)
    cu_seqlens = torch.tensor([0, 1, 6, 136], dtype=torch.int32)
    prefill = reference.paged_prefill_attention(
        chunk, layout.kv_layer, layout.block_tables, cu_seqlens, layout.context_lens, 0.1
    )
    positions = [torch.tensor([0]), torch.arange(32, 37), torch.arange(130)]
    assert_matches(prefill, naive_attention(chunk, layout, positions, 0.1), torch.float32)


def test_prefill_skips_sequences_without_queries():
    gen = torch.Generator().manual_seed(1)
    layout = random_layout([20, 9], 8, 1, 64, torch.float32, gen)
    query = make_query(4, 2, 64, torch.float32, gen)
    cu_seqlens = torch.tensor([0, 0, 4], dtype=torch.int32)
    out = reference.paged_prefill_attention(
        query, layout.kv_layer, layout.block_tables, cu_seqlens, layout.context_lens, 0.125
    )
    expected = naive_attention(query, layout, [torch.arange(0), torch.arange(5, 9)], 0.125)
    assert_matches(out, expected, torch.float32)


def test_decode_output_survives_the_next_call():
    """The gather workspace is reused across calls; outputs must never alias it."""
    gen = torch.Generator().manual_seed(2)
    layout = random_layout([40, 70], 16, 1, 64, torch.float32, gen)
    query = make_query(2, 3, 64, torch.float32, gen)
    args = (layout.kv_layer, layout.block_tables, layout.context_lens, 0.125)
    first = reference.paged_decode_attention(query, *args)
    kept = first.clone()
    reference.paged_decode_attention(make_query(2, 3, 64, torch.float32, gen), *args)
    assert torch.equal(first, kept)


def test_store_kv_writes_each_token_to_its_slot():
    gen = torch.Generator().manual_seed(3)
    kv_layer = torch.zeros(2, 6, 4, 2, 8)
    slots = torch.tensor([21, 3, 0, 12, 23])
    key, value = torch.randn(2, 5, 2, 8, generator=gen)
    reference.store_kv(key, value, kv_layer, slots)
    flat = kv_layer.view(2, 24, 2, 8)
    assert torch.equal(flat[0, slots], key)
    assert torch.equal(flat[1, slots], value)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].any()


def test_store_kv_reaches_the_whole_model_cache():
    """The runner passes ``kv_cache[layer]``: writes must land in the shared tensor, not a copy."""
    kv_cache = torch.zeros(3, 2, 4, 8, 1, 16)
    key, value = torch.ones(2, 1, 16), torch.full((2, 1, 16), 2.0)
    reference.store_kv(key, value, kv_cache[1], torch.tensor([9, 30]))
    assert torch.equal(kv_cache[1, 0, 1, 1], key[0]) and torch.equal(kv_cache[1, 1, 3, 6], value[1])
    assert not kv_cache[0].any() and not kv_cache[2].any()


@pytest.mark.parametrize("as_tensor", [False, True])
def test_copy_blocks_copies_every_layer_keys_and_values(as_tensor):
    gen = torch.Generator().manual_seed(4)
    kv_cache = torch.randn(3, 2, 10, 4, 2, 8, generator=gen)
    before = kv_cache.clone()
    src, dst = [1, 7, 4], [5, 2, 9]
    if as_tensor:
        reference.copy_blocks(kv_cache, torch.tensor(src), torch.tensor(dst))
    else:
        reference.copy_blocks(kv_cache, src, dst)
    assert torch.equal(kv_cache[:, :, dst], before[:, :, src])
    others = [b for b in range(10) if b not in dst]
    assert torch.equal(kv_cache[:, :, others], before[:, :, others])
    reference.copy_blocks(kv_cache, [], [])
    assert torch.equal(kv_cache[:, :, others], before[:, :, others])


def test_swap_out_and_back_in_restores_blocks():
    gen = torch.Generator().manual_seed(5)
    device_pool = torch.randn(2, 2, 12, 4, 2, 8, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    host_pool = torch.zeros(2, 2, 5, 4, 2, 8, dtype=torch.bfloat16)
    original = device_pool.clone()
    reference.swap_blocks(device_pool, host_pool, [3, 11, 0], torch.tensor([4, 0, 2]))
    assert torch.equal(host_pool[:, :, [4, 0, 2]], original[:, :, [3, 11, 0]])
    assert not host_pool[:, :, [1, 3]].any()

    device_pool[:, :, [3, 11, 0]] = 0
    reference.swap_blocks(host_pool, device_pool, [4, 0, 2], [6, 7, 8])
    assert torch.equal(device_pool[:, :, [6, 7, 8]], original[:, :, [3, 11, 0]])


def test_cpu_dispatch_never_touches_triton(monkeypatch):
    import kernels

    # A None entry in sys.modules makes any import of that name raise ImportError.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "kernels.triton_ops", None)
    gen = torch.Generator().manual_seed(6)
    layout = random_layout([5, 9], 4, 1, 16, generator=gen)
    query = make_query(2, 2, 16, torch.float32, gen)
    args = (layout.kv_layer, layout.block_tables, layout.context_lens, 0.25)
    out = kernels.paged_decode_attention(query, *args)
    expected = naive_attention(query, layout, [torch.tensor([4]), torch.tensor([8])], 0.25)
    assert_matches(out, expected, torch.float32)


def test_transformers_does_not_take_our_kernels_for_the_hub_kernels_package():
    """transformers probes for PyPI's ``kernels``; it resolves our package to the kvscope distribution."""
    from transformers.utils.import_utils import is_kernels_available

    assert not is_kernels_available()


def test_ragged_decode_batch_is_split_into_length_buckets():
    gen = torch.Generator().manual_seed(7)
    context_lens = torch.randint(1, 400, (40,), generator=gen).tolist()
    buckets = reference._length_buckets(context_lens)
    assert 1 < len(buckets) <= reference._MAX_BUCKETS
    assert sorted(i for rows in buckets for i in rows) == list(range(40))
    assert all(len(rows) >= reference._MIN_BUCKET_SEQS for rows in buckets)

    layout = random_layout(context_lens, 16, 1, 64, torch.float32, gen)
    query = make_query(40, 3, 64, torch.float32, gen)
    args = (layout.kv_layer, layout.block_tables, layout.context_lens, 0.1)
    out = reference.paged_decode_attention(query, *args)
    last_positions = [torch.tensor([length - 1]) for length in context_lens]
    assert_matches(out, naive_attention(query, layout, last_positions, 0.1), torch.float32)


@pytest.mark.parametrize("context_lens", [[5] * 30, [300] * 10 + [290] * 10, [3, 1000]])
def test_similar_or_few_lengths_stay_one_bucket(context_lens):
    assert len(reference._length_buckets(context_lens)) == 1


def test_workspace_serves_callers_inside_and_outside_inference_mode():
    """The engine gathers under inference_mode; a later plain caller must not get that read-only buffer."""
    from kernels.reference import _workspace

    device = torch.device("cpu")
    with torch.inference_mode():
        _workspace.take((8, 8), torch.float32, device)
    outside = _workspace.take((8, 8), torch.float32, device)
    outside.fill_(1.0)
    assert not outside.is_inference()
