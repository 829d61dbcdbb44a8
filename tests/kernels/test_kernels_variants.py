"""Sliding windows, soft-capped logits and attention sinks in the CPU kernels (the torch reference on each of its
decode paths, and the C++ kernels), against the naive float64 oracle.

The window contract is tested the way the engine will lean on it: after the oracle has read the pool, every
block-table entry of a block wholly before the earliest position a query sees is pointed far outside the pool
(``kernels.testing.poison_out_of_window``); a kernel that reads one fails or returns garbage.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels_reference import decode_path

from kvscope.kernels import cpu, reference
from kvscope.kernels.testing import assert_matches, make_query, naive_attention, poison_out_of_window, random_layout

needs_cpp = pytest.mark.skipif(not cpu.available(), reason=f"C++ kernels unavailable: {cpu.status()}")
BACKENDS = {
    "padded": (reference, "padded"),
    "tiled": (reference, "tiled"),
    "cpp": (cpu, None),
}
BACKEND_PARAMS = [pytest.param(name, marks=needs_cpp if name == "cpp" else ()) for name in BACKENDS]
FAST = settings(max_examples=25, deadline=None, derandomize=True, database=None)
VARIANTS = st.fixed_dictionaries({
    "sliding_window": st.one_of(st.none(), st.integers(1, 40)),
    "softcap": st.one_of(st.none(), st.sampled_from([5.0, 50.0])),
    "sinks": st.booleans(),
})


def _sinks(wanted: bool, num_q_heads: int, gen: torch.Generator) -> torch.Tensor | None:
    # Some large enough to outweigh every key: the denominator's sink term must be exact, not just present.
    return torch.randn(num_q_heads, generator=gen) * 4 if wanted else None


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@FAST
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([16, 64]), block_size=st.sampled_from([1, 4, 16]), num_kv_heads=st.integers(1, 2),
    context_lens=st.lists(st.integers(1, 120), min_size=1, max_size=6), variants=VARIANTS,
    seed=st.integers(0, 2**16),
)
def test_decode_with_variants_matches_naive(backend, dtype, group, head_dim, block_size, num_kv_heads,
                                            context_lens, variants, seed):
    module, path = BACKENDS[backend]
    gen = torch.Generator().manual_seed(seed)
    layout = random_layout(context_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    num_q_heads = num_kv_heads * group
    query = make_query(len(context_lens), num_q_heads, head_dim, dtype, gen)
    window, softcap = variants["sliding_window"], variants["softcap"]
    sinks = _sinks(variants["sinks"], num_q_heads, gen)
    scale = head_dim ** -0.5
    positions = [torch.tensor([length - 1]) for length in context_lens]
    expected = naive_attention(query, layout, positions, scale, window, softcap, sinks)
    if window is not None:
        poison_out_of_window(layout, [length - 1 for length in context_lens], window)
    with decode_path(path):
        out = module.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens,
                                            scale, sliding_window=window, softcap=softcap, sinks=sinks)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
@FAST
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([16, 64]), block_size=st.sampled_from([1, 4, 16]), num_kv_heads=st.integers(1, 2),
    chunks=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 40)), min_size=1, max_size=4)
    .filter(lambda chunks: any(length for _, length in chunks)),
    variants=VARIANTS, seed=st.integers(0, 2**16),
)
def test_chunked_prefill_with_variants_matches_naive(backend, dtype, group, head_dim, block_size, num_kv_heads,
                                                     chunks, variants, seed):
    """``chunks``: (tokens cached before this chunk, chunk length) per sequence; a length 0 has no queries."""
    module = reference if backend == "reference" else cpu
    gen = torch.Generator().manual_seed(seed)
    context_lens = [max(1, prefix + length) for prefix, length in chunks]
    layout = random_layout(context_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query_lens = [length for _, length in chunks]
    num_q_heads = num_kv_heads * group
    query = make_query(sum(query_lens), num_q_heads, head_dim, dtype, gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    window, softcap = variants["sliding_window"], variants["softcap"]
    sinks = _sinks(variants["sinks"], num_q_heads, gen)
    scale = head_dim ** -0.5
    firsts = [context - length for context, length in zip(context_lens, query_lens)]
    positions = [torch.arange(first, context) for first, context in zip(firsts, context_lens)]
    expected = naive_attention(query, layout, positions, scale, window, softcap, sinks)
    if window is not None:
        # A sequence without queries in this call reads nothing at all.
        poison_out_of_window(layout, [first if length else context + window
                                      for first, length, context in zip(firsts, query_lens, context_lens)], window)
    reference.clear_workspace()
    out = module.paged_prefill_attention(query, layout.kv_layer, layout.block_tables, cu_seqlens,
                                         layout.context_lens, scale, sliding_window=window, softcap=softcap,
                                         sinks=sinks)
    assert_matches(out, expected, dtype)


def test_a_sliding_and_a_full_layer_of_one_step_keep_their_own_plans():
    """Gemma-style models alternate windowed and full layers with the same tables: neither may serve the other."""
    gen = torch.Generator().manual_seed(3)
    context_lens = [50, 9, 33]
    layout = random_layout(context_lens, 4, 1, 16, torch.float32, gen)
    query = make_query(3, 2, 16, torch.float32, gen)
    positions = [torch.tensor([length - 1]) for length in context_lens]
    args = (query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.25)
    with decode_path(None):
        for window in (8, None, 8, None):
            out = reference.paged_decode_attention(*args, sliding_window=window)
            assert_matches(out, naive_attention(query, layout, positions, 0.25, window), torch.float32)
