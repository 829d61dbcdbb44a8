"""Split-KV decode and padded decode rows, interpreted on CPU, against the torch reference.

Partitions here are a few blocks long (the GPU's are 256 tokens) so that small contexts cross several partition
boundaries while the interpreter, about a thousand times slower than torch, stays quick.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvscope.kernels import reference, testing, triton_decode, triton_ops  # noqa: E402

assert isinstance(triton_ops._store_kv_kernel, InterpretedFunction), \
    "triton was imported before TRITON_INTERPRET=1 was set"

FP32, BF16 = torch.float32, torch.bfloat16


def _sinks(wanted: bool, num_q_heads: int, gen: torch.Generator) -> torch.Tensor | None:
    return torch.randn(num_q_heads, generator=gen) * 4 if wanted else None


# (group, num_kv_heads, block_size, dtype, context_lens, window, softcap, sinks, partition): contexts of one token,
# exactly a partition, one past it and several partitions; windows cutting into partitions (whole partitions
# before the window are never launched work); partitions of one block and of several.
SPLIT_CASES = [
    (3, 1, 8, FP32, [1, 16, 17, 70], None, None, False, 16),
    (1, 2, 16, BF16, [33, 64, 5], None, None, False, 32),
    (4, 1, 8, FP32, [70, 40], 24, 20.0, True, 16),
    (3, 1, 4, BF16, [50, 9], 5, None, True, 8),
    (1, 1, 32, FP32, [100], None, 5.0, True, 32),
    (1, 1, 4, FP32, [70, 3], 66, None, True, 4),     # 17 partitions: the reduction reads 16 at a time
]


@pytest.mark.parametrize("group, num_kv_heads, block_size, dtype, context_lens, window, softcap, sinks, partition",
                         SPLIT_CASES)
def test_split_decode_matches_reference(group, num_kv_heads, block_size, dtype, context_lens, window, softcap,
                                        sinks, partition):
    gen = torch.Generator().manual_seed(len(context_lens) * 100 + block_size + group)
    layout = testing.random_layout(context_lens, block_size, num_kv_heads, 64, dtype, gen)
    if window is not None:
        testing.poison_out_of_window(layout, [length - 1 for length in context_lens], window)
    query = testing.make_query(len(context_lens), num_kv_heads * group, 64, dtype, gen)
    variant = dict(sliding_window=window, softcap=softcap, sinks=_sinks(sinks, num_kv_heads * group, gen))
    args = (layout.kv_layer, layout.block_tables, layout.context_lens, 0.125)
    expected = reference.paged_decode_attention(query, *args, **variant)
    out = triton_ops.paged_decode_attention(query, *args, **variant, partition_size=partition)
    testing.assert_matches(out, expected.double(), dtype)


@pytest.mark.parametrize("partition", [0, 16])
def test_padded_decode_rows_read_and_write_nothing(partition):
    """Rows of context 0 (a batch padded to a graph's size) with block tables pointing outside the pool: the real
    rows match the reference, the padded rows of the output buffer and every cache byte stay as they were."""
    gen = torch.Generator().manual_seed(11)
    layout = testing.random_layout([0, 37, 0, 20], 8, 1, 64, FP32, gen)
    layout.block_tables[[0, 2]] = testing.POISON_BLOCK
    cache_before = layout.kv_layer.clone()
    query = testing.make_query(4, 3, 64, FP32, gen)
    sinks = torch.randn(3, generator=gen)
    out = torch.full((4, 3, 64), 7.0)
    triton_ops.paged_decode_attention(query, layout.kv_layer, layout.block_tables, layout.context_lens, 0.125,
                                      24, None, sinks, out=out, partition_size=partition)
    real = [1, 3]
    expected = reference.paged_decode_attention(query[real], layout.kv_layer, layout.block_tables[real],
                                                layout.context_lens[real], 0.125, 24, None, sinks)
    testing.assert_matches(out[real], expected.double(), FP32)
    assert torch.equal(out[[0, 2]], torch.full((2, 3, 64), 7.0))
    assert torch.equal(layout.kv_layer.nan_to_num(), cache_before.nan_to_num())


def test_padded_slots_store_nothing():
    """Slot -1 (a padded row's) stores nowhere: not before this layer's pool, not anywhere in it."""
    gen = torch.Generator().manual_seed(12)
    kv_cache = torch.zeros(2, 2, 4, 8, 2, 64)
    expected = kv_cache.clone()
    slots = torch.tensor([5, -1, 20, -1])
    key, value = torch.randn(2, 4, 2, 64, generator=gen)
    triton_ops.store_kv(key, value, kv_cache[1], slots)
    real = slots >= 0
    reference.store_kv(key[real], value[real], expected[1], slots[real])
    assert torch.equal(kv_cache, expected)


def test_split_rule_fills_idle_multiprocessors(monkeypatch):
    monkeypatch.setattr(triton_decode, "_multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert triton_decode.split_partition_size(8, 3, 2048, 16, cuda) == 256       # 24 programs: split
    assert triton_decode.split_partition_size(1, 1, 2048, 512, cuda) == 512      # whole blocks a partition
    assert triton_decode.split_partition_size(64, 3, 2048, 16, cuda) == 0        # 192 programs fill 132
    assert triton_decode.split_partition_size(8, 3, 256, 16, cuda) == 0          # one partition: nothing to split
    assert triton_decode.split_partition_size(8, 3, 2048, 16, torch.device("cpu")) == 0
