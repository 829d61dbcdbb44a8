"""The torch reference kernels (the CPU path) against a naive float64 oracle, on random paged layouts.

Every slot no sequence owns holds NaN (see ``kernels.testing.random_layout``), so reading past a context, or
through a padding column of a block table, cannot go unnoticed.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.kernels import reference
from kvscope.kernels.testing import PagedLayout, assert_matches, make_query, naive_attention, random_layout

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
GROUPS = st.sampled_from([1, 3, 4])
HEAD_DIMS = st.sampled_from([64, 128])
BLOCK_SIZES = st.sampled_from([8, 16, 32])
FAST = settings(max_examples=25, deadline=None, derandomize=True, database=None)


# Each decode path forced on whatever shape: "tiled" also shrinks tiles and chunks, so that short contexts
# span several tiles and a batch several chunks.
DECODE_PATHS = {
    "padded": ({"_PADDED_MAX_KEYS": 10**9}, "_PaddedDecode"),
    "tiled": ({"_PADDED_MAX_KEYS": 0, "_TILE": 8, "_CHUNK_KEYS": 24}, "_TiledDecode"),
}


@contextlib.contextmanager
def decode_path(path: str | None):
    settings = DECODE_PATHS[path][0] if path else {}
    saved = {name: getattr(reference, name) for name in settings}
    reference.clear_workspace()  # plans are cached per step; the settings change what a plan holds
    try:
        for name, value in settings.items():
            setattr(reference, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(reference, name, value)
        reference.clear_workspace()


def decode_plan():
    return reference._plans.entries["decode"][2]


def last_positions(context_lens: list[int]) -> list[torch.Tensor]:
    return [torch.tensor([length - 1]) for length in context_lens]


@pytest.mark.parametrize("path", [None, "padded", "tiled"])
@FAST
@given(
    dtype=DTYPES, group=GROUPS, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES,
    num_kv_heads=st.integers(1, 2), context_lens=st.lists(st.integers(1, 150), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_decode_matches_naive(path, dtype, group, head_dim, block_size, num_kv_heads, context_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    layout = random_layout(context_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query = make_query(len(context_lens), num_kv_heads * group, head_dim, dtype, gen)
    scale = head_dim ** -0.5

    with decode_path(path):
        out = reference.paged_decode_attention(
            query, layout.kv_layer, layout.block_tables, layout.context_lens, scale
        )
        if path:
            assert type(decode_plan()).__name__ == DECODE_PATHS[path][1]

    assert_matches(out, naive_attention(query, layout, last_positions(context_lens), scale), dtype)


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


@pytest.mark.parametrize("path", ["padded", "tiled"])
def test_decode_output_survives_the_next_call(path):
    """The gather workspace is reused across calls; outputs must never alias it."""
    gen = torch.Generator().manual_seed(2)
    layout = random_layout([40, 70], 16, 1, 64, torch.float32, gen)
    query = make_query(2, 3, 64, torch.float32, gen)
    args = (layout.kv_layer, layout.block_tables, layout.context_lens, 0.125)
    with decode_path(path):
        first = reference.paged_decode_attention(query, *args)
        kept = first.clone()
        reference.paged_decode_attention(make_query(2, 3, 64, torch.float32, gen), *args)
    assert torch.equal(first, kept)


@pytest.mark.parametrize("query_lens", [[0, 4], [3, 4]])
def test_prefill_output_survives_the_next_call(query_lens):
    gen = torch.Generator().manual_seed(12)
    layout = random_layout([20, 9], 8, 1, 64, torch.float32, gen)
    cu_seqlens = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32)
    args = (layout.kv_layer, layout.block_tables, cu_seqlens, layout.context_lens, 0.125)
    first = reference.paged_prefill_attention(make_query(sum(query_lens), 2, 64, torch.float32, gen), *args)
    kept = first.clone()
    reference.paged_prefill_attention(make_query(sum(query_lens), 2, 64, torch.float32, gen), *args)
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
    from kvscope.kernels import dispatch as kernels

    # A None entry in sys.modules makes any import of that name raise ImportError.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "kvscope.kernels.triton_ops", None)
    gen = torch.Generator().manual_seed(6)
    layout = random_layout([5, 9], 4, 1, 16, generator=gen)
    query = make_query(2, 2, 16, torch.float32, gen)
    args = (layout.kv_layer, layout.block_tables, layout.context_lens, 0.25)
    out = kernels.paged_decode_attention(query, *args)
    expected = naive_attention(query, layout, [torch.tensor([4]), torch.tensor([8])], 0.25)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("context_lens, path", [
    ([37], "_PaddedDecode"), ([5] * 30, "_PaddedDecode"), ([100, 3, 150], "_PaddedDecode"),
    ([600], "_TiledDecode"), ([5] * 200, "_TiledDecode"), ([3, 1000], "_TiledDecode"),
])
def test_small_batches_take_one_padded_sdpa_call_larger_ones_tiles(context_lens, path):
    """Padded: one gather and one SDPA call, fewest ops; tiled: no padding but a tile's tail, fewest bytes."""
    gen = torch.Generator().manual_seed(len(context_lens))
    layout = random_layout(context_lens, 16, 1, 64, torch.float32, gen)
    query = make_query(len(context_lens), 3, 64, torch.float32, gen)
    with decode_path(None):
        out = reference.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.1)
        assert type(decode_plan()).__name__ == path
    assert_matches(out, naive_attention(query, layout, last_positions(context_lens), 0.1), torch.float32)


def test_padded_path_needs_no_mask_when_all_contexts_are_as_long():
    gen = torch.Generator().manual_seed(8)
    layout = random_layout([23, 23, 23], 8, 2, 64, torch.float32, gen)
    query = make_query(3, 6, 64, torch.float32, gen)
    with decode_path("padded"):
        out = reference.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.1)
        assert decode_plan().mask is None
    assert_matches(out, naive_attention(query, layout, last_positions([23] * 3), 0.1), torch.float32)


@pytest.mark.parametrize("path", ["padded", "tiled"])
def test_float64_cache_keeps_float64_scores(path):
    gen = torch.Generator().manual_seed(9)
    context_lens = [1, 17, 40]
    layout = random_layout(context_lens, 8, 1, 64, torch.float64, gen)
    query = make_query(3, 3, 64, torch.float64, gen)
    with decode_path(path):
        out = reference.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.1)
    expected = naive_attention(query, layout, last_positions(context_lens), 0.1)
    assert out.dtype == torch.float64 and (out - expected).abs().max() < 1e-12


@pytest.mark.parametrize("path", ["padded", "tiled"])
def test_decode_plan_is_shared_by_layers_and_rebuilt_when_the_tables_change(path):
    """A step's plan serves every layer (same tables, another pool); equal contents, not identity, decide."""
    gen = torch.Generator().manual_seed(10)
    context_lens = [9, 30, 21]
    layer0 = random_layout(context_lens, 8, 1, 64, torch.float32, gen)
    layer1 = PagedLayout(layer0.kv_layer * -1.5, layer0.block_tables, layer0.context_lens)
    next_step = random_layout(context_lens, 8, 1, 64, torch.float32, gen)  # other blocks, other data
    query = make_query(3, 2, 64, torch.float32, gen)
    tables, lens = layer0.block_tables.clone(), layer0.context_lens.clone()
    with decode_path(path):
        out0 = reference.paged_decode_attention(query, layer0.kv_layer, tables, lens, 0.1)
        plan = decode_plan()
        out1 = reference.paged_decode_attention(query, layer1.kv_layer, tables.clone(), lens, 0.1)
        assert decode_plan() is plan
        tables.copy_(next_step.block_tables)  # a caller reusing its tensor in place for the next step
        out2 = reference.paged_decode_attention(query, next_step.kv_layer, tables, lens, 0.1)
        assert decode_plan() is not plan
    positions = last_positions(context_lens)
    for out, layout in ((out0, layer0), (out1, layer1), (out2, next_step)):
        assert_matches(out, naive_attention(query, layout, positions, 0.1), torch.float32)


def test_decode_of_an_empty_batch_is_empty():
    layout = random_layout([4], 8, 1, 64, torch.float32, torch.Generator().manual_seed(13))
    query = torch.empty(0, 2, 64)
    tables, lens = layout.block_tables[:0], layout.context_lens[:0]
    assert reference.paged_decode_attention(query, layout.kv_layer, tables, lens, 0.1).shape == (0, 2, 64)


def test_prefill_of_a_step_without_queries_is_empty():
    gen = torch.Generator().manual_seed(11)
    layout = random_layout([20, 9], 8, 1, 64, torch.float32, gen)
    query = make_query(0, 2, 64, torch.float32, gen)
    cu_seqlens = torch.zeros(3, dtype=torch.int32)
    out = reference.paged_prefill_attention(
        query, layout.kv_layer, layout.block_tables, cu_seqlens, layout.context_lens, 0.125
    )
    assert out.shape == (0, 2, 64)


def test_workspace_serves_callers_inside_and_outside_inference_mode():
    """The engine gathers under inference_mode; a later plain caller must not get that read-only buffer."""
    from kvscope.kernels.reference import _workspace

    device = torch.device("cpu")
    with torch.inference_mode():
        _workspace.take("test", (8, 8), torch.float32, device)
    outside = _workspace.take("test", (8, 8), torch.float32, device)
    outside.fill_(1.0)
    assert not outside.is_inference()
