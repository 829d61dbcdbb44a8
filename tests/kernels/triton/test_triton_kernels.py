"""The Triton kernels, interpreted on CPU, against the torch reference. Shapes stay small: the interpreter
runs every program instance in numpy, about a thousand times slower than torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvscope.kernels import reference, triton_ops  # noqa: E402
from kvscope.kernels.testing import poison_out_of_window, random_layout  # noqa: E402

# triton.language's own jit functions (tl.zeros) are interpreted only if triton itself was first imported under
# TRITON_INTERPRET=1: a test module collected earlier that imports triton would break every kernel here.
assert isinstance(triton_ops._store_kv_kernel, InterpretedFunction) and \
    isinstance(tl.zeros, InterpretedFunction), "triton was imported before TRITON_INTERPRET=1 was set"

FP32, BF16 = torch.float32, torch.bfloat16
TOLERANCE = {FP32: 1e-5, BF16: 2e-2}


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert not torch.isnan(out).any(), "NaN in kernel output"
    error = (out.double() - expected.double()).abs().max().item()
    assert error < TOLERANCE[out.dtype], f"max abs error {error}"


def make_query(num_tokens: int, num_q_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    # Built head-major then transposed: the kernels must follow the query's strides.
    return torch.randn(num_q_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)


# (group, num_kv_heads, head_dim, block_size, dtype, context_lens): GQA groups 1/3/4, head dims 64/128,
# block sizes 8/16/32 plus the extremes 1 and 128, ragged lengths crossing the 32-key tiles.
DECODE_CASES = [
    (1, 2, 64, 8, FP32, [1, 9, 70]),
    (3, 1, 128, 16, FP32, [16, 33, 100]),
    (4, 1, 64, 32, FP32, [64, 5, 130]),
    (3, 1, 64, 1, FP32, [3, 20]),
    (1, 1, 64, 128, FP32, [129, 7]),
    (3, 1, 64, 8, BF16, [2, 65, 40]),
    (4, 1, 128, 16, BF16, [17, 100]),
    (1, 2, 128, 32, BF16, [31, 96]),
]


@pytest.mark.parametrize("group, num_kv_heads, head_dim, block_size, dtype, context_lens", DECODE_CASES)
def test_decode_matches_reference(group, num_kv_heads, head_dim, block_size, dtype, context_lens):
    gen = torch.Generator().manual_seed(len(context_lens) * 100 + block_size + group)
    layout = random_layout(context_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query = make_query(len(context_lens), num_kv_heads * group, head_dim, dtype, gen)
    args = (layout.kv_layer, layout.block_tables, layout.context_lens, head_dim ** -0.5)
    assert_matches(triton_ops.paged_decode_attention(query, *args),
                   reference.paged_decode_attention(query, *args))


# (group, head_dim, block_size, dtype, chunks): a chunk is (tokens cached before it, its length); a zero
# prefix is a plain prompt, a non-zero one is a later chunk of chunked prefill or a prefix-cache hit.
PREFILL_CASES = [
    (1, 64, 8, FP32, [(0, 20), (13, 7), (40, 1)]),
    (3, 128, 16, FP32, [(0, 33), (50, 10)]),
    (4, 64, 32, FP32, [(70, 30), (0, 1)]),
    (3, 64, 8, BF16, [(0, 40), (20, 5)]),
    (4, 128, 16, BF16, [(33, 15)]),
    (1, 128, 32, BF16, [(0, 70), (64, 3)]),
]


@pytest.mark.parametrize("group, head_dim, block_size, dtype, chunks", PREFILL_CASES)
@pytest.mark.parametrize("pass_max_query_len", [False, True])
def test_prefill_matches_reference(group, head_dim, block_size, dtype, chunks, pass_max_query_len):
    gen = torch.Generator().manual_seed(block_size * 10 + group)
    context_lens = [prefix + length for prefix, length in chunks]
    layout = random_layout(context_lens, block_size, 1, head_dim, dtype, gen)
    query_lens = [length for _, length in chunks]
    query = make_query(sum(query_lens), group, head_dim, dtype, gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (layout.kv_layer, layout.block_tables, cu_seqlens, layout.context_lens, head_dim ** -0.5)
    max_query_len = max(query_lens) if pass_max_query_len else None
    assert_matches(triton_ops.paged_prefill_attention(query, *args, max_query_len),
                   reference.paged_prefill_attention(query, *args))


# (group, num_kv_heads, block_size, dtype, context_lens or chunks, sliding_window, softcap, sinks): windows that cut
# into tiles and blocks (1, 5, 24), Gemma 2's soft-cap, gpt-oss's sinks, and all three at once.
VARIANT_DECODE_CASES = [
    (1, 2, 8, FP32, [1, 9, 70], 24, None, False),
    (3, 1, 4, FP32, [16, 33, 100], 5, 20.0, True),
    (4, 1, 16, BF16, [17, 100], 24, None, True),
    (1, 1, 8, FP32, [40, 3], None, 5.0, False),
    (3, 1, 8, FP32, [50], 1, None, False),
]
VARIANT_PREFILL_CASES = [
    (1, 1, 8, FP32, [(0, 40), (13, 7), (40, 1)], 24, None, False),
    (3, 2, 4, FP32, [(0, 33), (50, 10)], 5, 20.0, True),
    (4, 1, 16, BF16, [(70, 30), (0, 1)], 24, None, True),
    (1, 1, 8, FP32, [(20, 20)], None, 5.0, False),
]


def _sinks(wanted: bool, num_q_heads: int, gen: torch.Generator) -> torch.Tensor | None:
    return torch.randn(num_q_heads, generator=gen) * 4 if wanted else None


@pytest.mark.parametrize("group, num_kv_heads, block_size, dtype, context_lens, window, softcap, sinks",
                         VARIANT_DECODE_CASES)
def test_decode_with_variants_matches_reference(group, num_kv_heads, block_size, dtype, context_lens, window,
                                                softcap, sinks):
    """Block-table entries before each window point far outside the pool: neither kernel may read them."""
    gen = torch.Generator().manual_seed(len(context_lens) * 100 + block_size + group)
    layout = random_layout(context_lens, block_size, num_kv_heads, 64, dtype, gen)
    if window is not None:
        poison_out_of_window(layout, [length - 1 for length in context_lens], window)
    query = make_query(len(context_lens), num_kv_heads * group, 64, dtype, gen)
    variant = dict(sliding_window=window, softcap=softcap, sinks=_sinks(sinks, num_kv_heads * group, gen))
    args = (layout.kv_layer, layout.block_tables, layout.context_lens, 0.125)
    assert_matches(triton_ops.paged_decode_attention(query, *args, **variant),
                   reference.paged_decode_attention(query, *args, **variant))


@pytest.mark.parametrize("group, num_kv_heads, block_size, dtype, chunks, window, softcap, sinks",
                         VARIANT_PREFILL_CASES)
def test_chunked_prefill_with_variants_matches_reference(group, num_kv_heads, block_size, dtype, chunks, window,
                                                         softcap, sinks):
    gen = torch.Generator().manual_seed(block_size * 10 + group)
    context_lens = [prefix + length for prefix, length in chunks]
    layout = random_layout(context_lens, block_size, num_kv_heads, 64, dtype, gen)
    if window is not None:
        poison_out_of_window(layout, [prefix for prefix, _ in chunks], window)
    query_lens = [length for _, length in chunks]
    query = make_query(sum(query_lens), num_kv_heads * group, 64, dtype, gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    variant = dict(sliding_window=window, softcap=softcap, sinks=_sinks(sinks, num_kv_heads * group, gen))
    args = (layout.kv_layer, layout.block_tables, cu_seqlens, layout.context_lens, 0.125)
    assert_matches(triton_ops.paged_prefill_attention(query, *args, max(query_lens), **variant),
                   reference.paged_prefill_attention(query, *args, **variant))


@pytest.mark.parametrize("num_kv_heads, head_dim, block_size, dtype", [(2, 64, 8, FP32), (3, 128, 16, BF16)])
def test_store_kv_matches_reference(num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(7)
    kv_cache = torch.zeros(2, 2, 6, block_size, num_kv_heads, head_dim, dtype=dtype)
    expected = kv_cache.clone()
    slots = torch.randperm(6 * block_size, generator=gen)[:9]
    # Keys arrive head-major (as attention hands them over), values token-major.
    key = torch.randn(num_kv_heads, 9, head_dim, generator=gen).to(dtype).transpose(0, 1)
    value = torch.randn(9, num_kv_heads, head_dim, generator=gen).to(dtype)
    triton_ops.store_kv(key, value, kv_cache[1], slots)
    reference.store_kv(key, value, expected[1], slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_copy_blocks_matches_reference(dtype):
    gen = torch.Generator().manual_seed(8)
    kv_cache = torch.randn(3, 2, 9, 8, 2, 64, generator=gen).to(dtype)
    expected = kv_cache.clone()
    triton_ops.copy_blocks(kv_cache, [0, 5, 3], torch.tensor([8, 1, 4]))
    reference.copy_blocks(expected, [0, 5, 3], [8, 1, 4])
    assert torch.equal(kv_cache, expected)


def test_stored_tokens_are_what_decode_reads():
    """store_kv then decode, both Triton, against the reference doing the same on its own pool."""
    gen = torch.Generator().manual_seed(9)
    layout = random_layout([12, 30], 8, 1, 64, FP32, gen)
    pool = layout.kv_layer.clone()
    new_slots = torch.stack([layout.slots(0)[-1], layout.slots(1)[-1]])
    key, value = torch.randn(2, 2, 1, 64, generator=gen)
    triton_ops.store_kv(key, value, pool, new_slots)
    reference.store_kv(key, value, layout.kv_layer, new_slots)
    query = make_query(2, 3, 64, FP32, gen)
    out = triton_ops.paged_decode_attention(query, pool, layout.block_tables, layout.context_lens, 0.125)
    expected = reference.paged_decode_attention(
        query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.125
    )
    assert_matches(out, expected)


def test_kernels_compile_for_hopper():
    """The real compiler lowers every kernel to a cubin for sm_90 (Hopper), without heavy spills."""
    pytest.importorskip("triton.backends.nvidia")
    script = Path(__file__).with_name("aot_compile.py")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's notice about the coming default
    result = subprocess.run([sys.executable, str(script), "--sm", "90", "--head-dim", "128"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    builds = [json.loads(line) for line in result.stdout.splitlines()]
    assert {build["kernel"] for build in builds} == {"decode", "prefill", "store_kv", "copy_blocks"}
    for build in builds:
        assert build.get("stack", 0) <= 64, build
