"""The C++ CPU kernels against the naive float64 oracle, their fallbacks, and the huge-page KV pool.

As for the torch reference, every slot no sequence owns holds NaN, so a kernel reading past a context, or
through a padding column of a block table, shows up. Without a C++ compiler these tests check the fallback only.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.kernels import cpu, reference
from kvscope.kernels import dispatch as kernels
from kvscope.kernels.testing import assert_matches, make_query, naive_attention, random_layout

needs_cpp = pytest.mark.skipif(not cpu.available(), reason=f"C++ kernels unavailable: {cpu.status()}")
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
GROUPS = st.sampled_from([1, 3, 4, 7])
HEAD_DIMS = st.sampled_from([16, 32, 64, 128, 256])
BLOCK_SIZES = st.sampled_from([1, 4, 8, 16, 32])
FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None)


@needs_cpp
@FAST
@given(
    dtype=DTYPES, group=GROUPS, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES, num_kv_heads=st.integers(1, 3),
    context_lens=st.lists(st.integers(1, 150), min_size=1, max_size=20), seed=st.integers(0, 2**16),
)
def test_decode_matches_naive(dtype, group, head_dim, block_size, num_kv_heads, context_lens, seed):
    # Up to 20 sequences: both work splits (one kv head per item, whole sequences per item) are taken.
    gen = torch.Generator().manual_seed(seed)
    layout = random_layout(context_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query = make_query(len(context_lens), num_kv_heads * group, head_dim, dtype, gen)
    scale = head_dim ** -0.5
    out = cpu.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, scale)
    positions = [torch.tensor([length - 1]) for length in context_lens]
    assert_matches(out, naive_attention(query, layout, positions, scale), dtype)


@needs_cpp
@FAST
@given(
    dtype=DTYPES, group=GROUPS, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES, num_kv_heads=st.integers(1, 2),
    chunks=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 40)), min_size=1, max_size=4)
    .filter(lambda chunks: any(length for _, length in chunks)),
    seed=st.integers(0, 2**16),
)
def test_prefill_matches_naive(dtype, group, head_dim, block_size, num_kv_heads, chunks, seed):
    """``chunks``: (tokens cached before this chunk, chunk length) per sequence; a length 0 has no queries."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [max(1, prefix + length) for prefix, length in chunks]
    layout = random_layout(context_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query_lens = [length for _, length in chunks]
    query = make_query(sum(query_lens), num_kv_heads * group, head_dim, dtype, gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim ** -0.5
    out = cpu.paged_prefill_attention(query, layout.kv_layer, layout.block_tables, cu_seqlens,
                                      layout.context_lens, scale)
    positions = [torch.arange(total - length, total) for total, length in zip(context_lens, query_lens)]
    assert_matches(out, naive_attention(query, layout, positions, scale), dtype)


@needs_cpp
def test_long_contexts_and_one_long_prefill():
    """Scores of a 3000-token context and a 700-token chunk over a 1500-token prefix: many tiles, both passes."""
    gen = torch.Generator().manual_seed(7)
    layout = random_layout([3000, 2200], 16, 3, 64, torch.float32, gen)
    query = make_query(2, 9, 64, torch.float32, gen)
    out = cpu.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.125)
    assert_matches(out, naive_attention(query, layout, [torch.tensor([2999]), torch.tensor([2199])], 0.125),
                   torch.float32)
    chunk = make_query(700, 9, 64, torch.float32, gen)
    cu_seqlens = torch.tensor([0, 0, 700], dtype=torch.int32)
    out = cpu.paged_prefill_attention(chunk, layout.kv_layer, layout.block_tables, cu_seqlens,
                                      layout.context_lens, 0.125)
    expected = naive_attention(chunk, layout, [torch.arange(0), torch.arange(1500, 2200)], 0.125)
    assert_matches(out, expected, torch.float32)


@needs_cpp
def test_int64_tables_and_empty_batches_are_accepted():
    gen = torch.Generator().manual_seed(8)
    layout = random_layout([5, 17], 4, 1, 16, torch.float32, gen)
    query = make_query(2, 2, 16, torch.float32, gen)
    out = cpu.paged_decode_attention(query, layout.kv_layer, layout.block_tables.long(), layout.context_lens.long(),
                                     0.25)
    expected = naive_attention(query, layout, [torch.tensor([4]), torch.tensor([16])], 0.25)
    assert_matches(out, expected, torch.float32)
    empty = cpu.paged_decode_attention(query[:0], layout.kv_layer, layout.block_tables[:0],
                                       layout.context_lens[:0], 0.25)
    assert empty.shape == (0, 2, 16)


@needs_cpp
def test_unsupported_shapes_and_dtypes_take_the_reference(monkeypatch):
    """float16 and a head_dim the C++ code has no instance for are served by the torch reference."""
    calls = []
    monkeypatch.setattr(reference, "paged_decode_attention",
                        lambda *args: calls.append(args[0].dtype) or torch.zeros(args[0].shape, dtype=args[0].dtype))
    gen = torch.Generator().manual_seed(9)
    for dtype, head_dim in ((torch.float16, 64), (torch.float32, 80)):
        layout = random_layout([6], 4, 1, head_dim, dtype, gen)
        query = make_query(1, 1, head_dim, dtype, gen)
        cpu.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.1)
    assert calls == [torch.float16, torch.float32]


def test_cpu_dispatch_serves_through_the_cpu_module():
    gen = torch.Generator().manual_seed(10)
    layout = random_layout([9, 30], 8, 2, 64, torch.bfloat16, gen)
    query = make_query(2, 4, 64, torch.bfloat16, gen)
    out = kernels.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.125)
    expected = naive_attention(query, layout, [torch.tensor([8]), torch.tensor([29])], 0.125)
    assert_matches(out, expected, torch.bfloat16)


_FALLBACK_PROBE = """
import torch
from kvscope.kernels import dispatch as kernels
from kvscope.kernels import cpu
from kvscope.kernels.testing import make_query, naive_attention, random_layout
print(cpu.status())
gen = torch.Generator().manual_seed(0)
layout = random_layout([7, 20], 4, 1, 16, torch.float32, gen)
query = make_query(2, 2, 16, torch.float32, gen)
out = kernels.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.25)
expected = naive_attention(query, layout, [torch.tensor([6]), torch.tensor([19])], 0.25)
print((out.double() - expected).abs().max().item() < 1e-5)
"""


@pytest.mark.parametrize("setting", [{"CXX": "/nonexistent/c++"}, {"KVSCOPE_CPU_KERNELS": "torch"}])
def test_without_the_cpp_kernels_the_torch_path_serves(tmp_path, setting):
    """No compiler: one line on stderr says so, and attention is still right. Forced off: no line at all."""
    env = os.environ | {"KVSCOPE_CACHE": str(tmp_path)} | setting
    result = subprocess.run([sys.executable, "-c", _FALLBACK_PROBE], env=env, capture_output=True, text=True,
                            timeout=300, check=True, cwd=tmp_path)
    status, correct = result.stdout.split("\n")[:2]
    assert status.startswith("torch kernels") and correct == "True"
    warnings = [line for line in result.stderr.splitlines() if line.startswith("kvscope:")]
    if "CXX" in setting:
        assert warnings == ["kvscope: C++ CPU kernels unavailable (no C++ compiler found (install g++, or set CXX)); "
                            "using the torch attention path (slower)"]
    else:
        assert warnings == []
    assert not list(tmp_path.glob("kernels/*.so"))


def test_the_kv_pool_is_zeroed_and_asks_for_huge_pages():
    pool = kernels.kv_pool_zeros((2, 2, 64, 16, 2, 64), torch.bfloat16, torch.device("cpu"))
    assert pool.shape == (2, 2, 64, 16, 2, 64) and pool.dtype == torch.bfloat16 and not pool.any()
    small = kernels.kv_pool_zeros((2, 3), torch.float32, torch.device("cpu"))  # under one huge page: plain zeros
    assert not small.any()


def test_a_failing_build_falls_back_to_the_torch_path_with_one_line(monkeypatch, tmp_path, capsys):
    """The build step fails (as it does without a working compiler): one stderr line, then the torch path."""
    def failing_build(compiler, target):
        raise cpu.BuildError("c++ failed: simulated")

    monkeypatch.setattr(cpu, "_compiler", lambda: "c++")
    monkeypatch.setattr(cpu, "_library_path", lambda compiler: tmp_path / "kvscope_cpu-missing.so")
    monkeypatch.setattr(cpu, "_build", failing_build)
    monkeypatch.delenv("KVSCOPE_CPU_KERNELS", raising=False)
    cpu.status.cache_clear()
    try:
        served = []
        monkeypatch.setattr(reference, "paged_decode_attention", lambda *args: served.append(1) or args[0] * 0)
        gen = torch.Generator().manual_seed(11)
        layout = random_layout([5, 9], 4, 1, 64, torch.float32, gen)
        query = make_query(2, 2, 64, torch.float32, gen)
        for _ in range(3):
            kernels.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.1)
        assert served == [1, 1, 1] and not cpu.available()
        assert capsys.readouterr().err.splitlines() == [
            "kvscope: C++ CPU kernels unavailable (c++ failed: simulated); using the torch attention path (slower)"]
    finally:
        cpu.status.cache_clear()  # the next caller finds the real build again


@needs_cpp
@pytest.mark.parametrize("bad_id", [-1, 10**6])
def test_a_block_id_outside_the_pool_is_refused_by_name_not_read(bad_id):
    gen = torch.Generator().manual_seed(9)
    layout = random_layout([5, 17], 4, 1, 16, torch.float32, gen)
    num_blocks = layout.kv_layer.shape[1]
    tables = layout.block_tables.clone()
    tables[1, 3] = bad_id if bad_id < 0 else num_blocks + bad_id     # one the second sequence reads
    query = make_query(2, 2, 16, torch.float32, gen)
    with pytest.raises(RuntimeError, match=f"sequence 1 reads block id {tables[1, 3].item()} at table entry 3, "
                                           f"outside the pool of {num_blocks} blocks"):
        cpu.paged_decode_attention(query, layout.kv_layer, tables, layout.context_lens, 0.25)
    chunk = make_query(17, 2, 16, torch.float32, gen)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.paged_prefill_attention(chunk, layout.kv_layer, tables, torch.tensor([0, 0, 17], dtype=torch.int32),
                                    layout.context_lens, 0.25)
    # the tables as they were still serve
    out = cpu.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.25)
    assert_matches(out, naive_attention(query, layout, [torch.tensor([4]), torch.tensor([16])], 0.25), torch.float32)
