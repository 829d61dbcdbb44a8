"""Paged decode attention in Triton: one query row per sequence, the group of query heads sharing a KV head as
the rows of one program.

Unsplit, one program per (sequence, KV head) walks the whole context. That leaves most of a GPU idle when the
batch is small (batch 8 × 3 KV heads is 24 programs on 132 multiprocessors), so then decode splits each context
into partitions of ``PARTITION`` tokens (a multiple of the block size): one program per (sequence, KV head,
partition) leaves its partition's running max, sum and unnormalised output, and a reduction program per
(sequence, query head) combines them by the log-sum-exp rule, with the sink (when the layer has one) entering
there, once. ``split_partition_size`` is the one rule that chooses.

Rows whose context length is 0 are padding (a decode batch padded up to a captured CUDA-graph size): their
programs return before loading anything, so they read no block table, no cache and no query, and write no
output. The grid is sized from the block table's width, never from the context lengths, so launching needs no
device-to-host copy and a captured launch stays valid for any lengths that fit the table.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvscope.kernels import triton_attend as shared
from kvscope.kernels.triton_attend import attend_tile, softmax_start

__all__ = ["decode_meta", "paged_decode_attention", "reduce_meta", "split_partition_size"]

# Tokens a split program walks: long enough that its fixed cost (loading the query, writing partials) is small
# against its loop, short enough that a batch-1 request of a few thousand tokens fills a GPU's multiprocessors.
PARTITION_TOKENS = 256


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_partition_size(num_seqs: int, num_kv_heads: int, max_context_len: int, block_size: int,
                         device: torch.device) -> int:
    """Tokens per partition for a split decode, or 0 for one program per (sequence, KV head): split on a GPU when
    the unsplit grid leaves multiprocessors idle and a context can span more than one partition."""
    if device.type != "cuda" or num_seqs * num_kv_heads >= _multiprocessors(device.index or 0):
        return 0
    partition = max(PARTITION_TOKENS, block_size)
    return partition if max_context_len > partition else 0


@triton.jit
def _paged_decode_kernel(
    out_ptr, partial_max_ptr, partial_sum_ptr, partial_acc_ptr, q_ptr, cache_ptr, block_tables_ptr,
    context_lens_ptr, sinks_ptr, scale_log2e, softcap_log2e, sliding_window, num_partitions,
    stride_q_seq, stride_q_head, stride_out_seq, stride_out_head, stride_bt_seq,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PARTITION: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """PARTITION 0: the whole context, normalised into ``out``. Otherwise partition ``program_id(2)``'s
    (max, sum, accumulator) into the partial buffers ([seq, query head, partition(, dim)], contiguous)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    key_start = 0
    if sliding_window > 0:
        key_start = tl.maximum(context_len - sliding_window, 0)
    key_end = context_len
    if PARTITION > 0:
        part = tl.program_id(2)
        key_start = tl.maximum(key_start, part * PARTITION)
        key_end = tl.minimum(context_len, (part + 1) * PARTITION)
    # A padded row (context 0), or a partition past the context or before the window: nothing to read or write.
    if key_start >= key_end:
        return
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    row_mask = (rows < GROUP)[:, None] & dim_mask[None, :]
    q_heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
    m_i, l_i = softmax_start(sinks_ptr, q_heads, rows < GROUP, BLOCK_G, HAS_SINKS)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in range(key_start, key_end, TILE):
        key_pos = tile_start + tl.arange(0, TILE)
        key_in_range = key_pos < key_end
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, cache_ptr, block_table_row_ptr, key_pos, key_in_range, key_in_range[None, :],
            kv_head, dims, dim_mask, scale_log2e, softcap_log2e,
            stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
            BLOCK_SIZE, COMPUTE_DTYPE, DOT_PRECISION, HAS_SOFTCAP,
        )
    if PARTITION > 0:
        num_q_heads = tl.num_programs(1) * GROUP
        slots = (seq.to(tl.int64) * num_q_heads + q_heads) * num_partitions + part
        tl.store(partial_max_ptr + slots, m_i, mask=rows < GROUP)
        tl.store(partial_sum_ptr + slots, l_i, mask=rows < GROUP)
        tl.store(partial_acc_ptr + slots[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, partial_max_ptr, partial_sum_ptr, partial_acc_ptr, context_lens_ptr, sinks_ptr, sliding_window,
    num_partitions, stride_out_seq, stride_out_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION: tl.constexpr, PARTS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One (sequence, query head): rescale each written partition to the largest max and normalise once.
    Partitions are read ``PARTS`` at a time, keeping element-wise running values reduced after the loops."""
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    if context_len == 0:
        return
    first_key = 0
    if sliding_window > 0:
        first_key = tl.maximum(context_len - sliding_window, 0)
    # Exactly the partitions whose programs wrote (see the kernel above).
    first_part = first_key // PARTITION
    end_part = (context_len + PARTITION - 1) // PARTITION
    base = (seq.to(tl.int64) * tl.num_programs(1) + q_head) * num_partitions
    dims = tl.arange(0, BLOCK_D)
    running_max = tl.full([PARTS], float("-inf"), tl.float32)
    for start in range(first_part, end_part, PARTS):
        parts = start + tl.arange(0, PARTS)
        maxes = tl.load(partial_max_ptr + base + parts, mask=parts < end_part, other=float("-inf"))
        running_max = tl.maximum(running_max, maxes)
    top = tl.max(running_max, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + q_head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    sums = tl.zeros([PARTS], tl.float32)
    acc = tl.zeros([PARTS, BLOCK_D], tl.float32)
    for start in range(first_part, end_part, PARTS):
        parts = start + tl.arange(0, PARTS)
        written = parts < end_part
        weights = tl.exp2(tl.load(partial_max_ptr + base + parts, mask=written, other=float("-inf")) - top)
        sums += tl.load(partial_sum_ptr + base + parts, mask=written, other=0.0) * weights
        partial = tl.load(partial_acc_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
                          mask=written[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        acc += partial * weights[:, None]
    total = tl.sum(sums, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(acc, 0) / total
    tl.store(out_ptr + seq * stride_out_seq + q_head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def paged_decode_attention(query, kv_layer, block_tables, context_lens, scale, sliding_window=None, softcap=None,
                           sinks=None, *, out: torch.Tensor | None = None,
                           partition_size: int | None = None) -> torch.Tensor:
    """The reference's contract (kernels/reference.py): one query row per sequence. Beyond it: ``out``, a
    buffer to write into (a captured graph's; rows with context 0 are left as they were), and
    ``partition_size``, tokens per split partition (0: unsplit; None: ``split_partition_size`` decides)."""
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    query, block_tables = shared.last_dim_contiguous(query), shared.last_dim_contiguous(block_tables)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    assert kv_layer.stride(-1) == 1 and out.stride(-1) == 1, "kv cache and output must be contiguous in head_dim"
    max_context_len = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = split_partition_size(num_seqs, num_kv_heads, max_context_len, block_size, query.device)
    assert partition_size % block_size == 0, "a partition holds whole blocks"
    sinks_ptr, scale_log2e, softcap_log2e, window = shared.variant_args(query, scale, sliding_window, softcap, sinks)
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
               kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3))
    meta = decode_meta(kv_layer.dtype, num_q_heads // num_kv_heads, head_dim, block_size, partition_size)
    if not partition_size:
        _paged_decode_kernel[(num_seqs, num_kv_heads, 1)](
            out, out, out, out, query, kv_layer, block_tables, context_lens, sinks_ptr, scale_log2e, softcap_log2e,
            window, 1, *strides, **meta, **shared.variant_meta(softcap, sinks),
        )
        return out
    num_partitions = triton.cdiv(max_context_len, partition_size)
    partial_max = torch.empty((num_seqs, num_q_heads, num_partitions), dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    partial_acc = torch.empty((*partial_max.shape, head_dim), dtype=torch.float32, device=query.device)
    partials = (partial_max, partial_sum, partial_acc)
    # The sink enters once, in the reduction; the partitions' softmaxes start from nothing.
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, *partials, query, kv_layer, block_tables, context_lens, sinks_ptr, scale_log2e, softcap_log2e,
        window, num_partitions, *strides, **meta, **shared.variant_meta(softcap, None),
    )
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        out, *partials, context_lens, sinks_ptr, window, num_partitions, out.stride(0), out.stride(1),
        **reduce_meta(head_dim, partition_size), HAS_SINKS=sinks is not None,
    )
    return out


def decode_meta(dtype: torch.dtype, group: int, head_dim: int, block_size: int, partition: int = 0) -> dict:
    """Compile-time parameters and launch options of the decode kernel (``partition`` 0: unsplit)."""
    # Tile and warp counts chosen so sm_80/sm_90 builds keep everything in registers (no spills).
    block_d = shared.pow2_at_least(head_dim, shared.MIN_DOT)
    return dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=shared.pow2_at_least(group, shared.MIN_DOT), BLOCK_D=block_d, TILE=32, PARTITION=partition,
        COMPUTE_DTYPE=shared.compute_dtype(dtype), DOT_PRECISION=shared.dot_precision(dtype),
        num_warps=4 if block_d <= 64 else 8,
    )


def reduce_meta(head_dim: int, partition: int) -> dict:
    """Compile-time parameters and launch options of the split decode's reduction."""
    return dict(HEAD_DIM=head_dim, BLOCK_D=shared.pow2_at_least(head_dim), PARTITION=partition, PARTS=16, num_warps=4)

