"""Paged-attention Triton kernels: the CUDA path. Same functions and semantics as ``kernels.reference``.

Keys are walked in tiles of ``TILE`` token positions, independent of the cache's block size: each position
looks up its own block id, so block sizes below the 16-wide minimum of ``tl.dot`` (and any power of two up to
256) need no special case. Scores and softmax statistics are fp32 throughout (online softmax, exp2 domain).

A layer's variant (kernels/variants.py): a sliding window (a runtime argument, 0 for none: the loops over keys
start at the earliest position a program's queries see, so block-table entries before it are never loaded),
soft-capped logits and attention sinks (compile-time switches, their values runtime arguments). Both fold into
the exp2 domain: c * tanh(s / c) * log2(e) is (c log2 e) * tanh(s log2 e / (c log2 e)), and a sink starts the
online softmax as a score that carries no value.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors for testing. The interpreter keeps bf16 as raw
uint16 in numpy, so its arithmetic and ``tl.dot`` on bf16 are meaningless; there the kernels upcast loaded
values to fp32 before computing. On a GPU, 16-bit caches use native 16-bit dots with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kvscope.kernels.reference import BlockIds, swap_blocks

__all__ = ["copy_blocks", "paged_decode_attention", "paged_prefill_attention", "store_kv", "swap_blocks"]

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
_TORCH_TO_TRITON = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _compute_dtype(dtype: torch.dtype) -> tl.dtype:
    # Whether the kernels were built for the interpreter was fixed when this module was imported.
    return tl.float32 if isinstance(_store_kv_kernel, InterpretedFunction) else _TORCH_TO_TRITON[dtype]


def _dot_precision(dtype: torch.dtype) -> str:
    # Default fp32 dots on NVIDIA round to tf32 (~1e-3 error); ask for full precision. Ignored for 16-bit.
    return "ieee" if dtype == torch.float32 else "tf32"


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------------
# store_kv


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
    dst = dst + heads[:, None] * stride_cache_head + dims[None, :]
    key_src = key_ptr + token * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :]
    tl.store(cache_ptr + dst, tl.load(key_src, mask=mask), mask=mask)
    value_src = value_ptr + token * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :]
    tl.store(cache_ptr + stride_cache_kv + dst, tl.load(value_src, mask=mask), mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    assert kv_layer.stride(-1) == 1, "kv cache must be contiguous in head_dim"
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_layer, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        **store_kv_meta(num_heads, head_dim, kv_layer.shape[2]),
    )


def store_kv_meta(num_heads: int, head_dim: int, block_size: int) -> dict:
    return dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                BLOCK_H=_pow2_at_least(num_heads), BLOCK_D=_pow2_at_least(head_dim))


# ----------------------------------------------------------------------------------------------------
# Shared inner loop: one tile of keys/values folded into a running (max, sum, accumulator).


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, cache_ptr, block_table_row_ptr, key_pos, key_in_range, key_visible, kv_head, dims,
    dim_mask, scale_log2e, softcap_log2e,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    BLOCK_SIZE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """``key_in_range`` [TILE] guards the loads; ``key_visible`` ([M or 1, TILE]) masks the scores."""
    block = tl.load(block_table_row_ptr + key_pos // BLOCK_SIZE, mask=key_in_range, other=0).to(tl.int64)
    rows = block * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot
    rows = rows + kv_head * stride_cache_head
    load_mask = key_in_range[:, None] & dim_mask[None, :]
    keys = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=load_mask, other=0.0).to(COMPUTE_DTYPE)
    scores = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2e
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (e^2x + 1): exact at both ends (e^2x overflowing to inf gives 1).
        scores = softcap_log2e * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap_log2e) + 1.0))
    scores = tl.where(key_visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen nothing yet keeps m = -inf; keep its arithmetic finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    probs = tl.exp2(scores - m_safe[:, None])
    values = tl.load(cache_ptr + stride_cache_kv + rows[:, None] + dims[None, :], mask=load_mask, other=0.0)
    values = values.to(COMPUTE_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(probs.to(COMPUTE_DTYPE), values, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(probs, 1)
    return m_new, l_i, acc


@triton.jit
def _softmax_start(sinks_ptr, q_heads, row_valid, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The online softmax's running (max, sum) before any key: nothing, or each row's sink (e^0 = 1 of itself)."""
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + q_heads, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([ROWS], 1.0, tl.float32)
    else:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
    return m_i, l_i


# ----------------------------------------------------------------------------------------------------
# Decode: one program per (sequence, kv head); the group of query heads sharing that kv head are the rows.


@triton.jit
def _paged_decode_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, context_lens_ptr, sinks_ptr, scale_log2e, softcap_log2e,
    sliding_window,
    stride_q_seq, stride_q_head, stride_out_seq, stride_out_head, stride_bt_seq,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    row_mask = (rows < GROUP)[:, None] & dim_mask[None, :]
    q_heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
    m_i, l_i = _softmax_start(sinks_ptr, q_heads, rows < GROUP, BLOCK_G, HAS_SINKS)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    first_key = 0
    if sliding_window > 0:
        first_key = tl.maximum(context_len - sliding_window, 0)
    for tile_start in range(first_key, context_len, TILE):
        key_pos = tile_start + tl.arange(0, TILE)
        key_in_range = key_pos < context_len
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, cache_ptr, block_table_row_ptr, key_pos, key_in_range, key_in_range[None, :],
            kv_head, dims, dim_mask, scale_log2e, softcap_log2e,
            stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
            BLOCK_SIZE, COMPUTE_DTYPE, DOT_PRECISION, HAS_SOFTCAP,
        )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_decode_attention(query, kv_layer, block_tables, context_lens, scale, sliding_window=None, softcap=None,
                           sinks=None) -> torch.Tensor:
    """The reference's contract (kernels/reference.py): one query row per sequence."""
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_layer.shape[3]
    query, block_tables = _last_dim_contiguous(query), _last_dim_contiguous(block_tables)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    assert kv_layer.stride(-1) == 1, "kv cache must be contiguous in head_dim"
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, query, kv_layer, block_tables, context_lens, *_variant_args(query, scale, sliding_window, softcap, sinks),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        **decode_meta(kv_layer.dtype, num_q_heads // num_kv_heads, head_dim, kv_layer.shape[2]),
        **_variant_meta(softcap, sinks),
    )
    return out


def _variant_args(query: torch.Tensor, scale: float, sliding_window: int | None, softcap: float | None,
                  sinks: torch.Tensor | None) -> tuple:
    """sinks_ptr (the query stands in when there are none: never read), scale and softcap in the exp2 domain,
    and the window (0: none)."""
    sinks_ptr = query if sinks is None else sinks.detach().to(device=query.device, dtype=torch.float32).contiguous()
    return sinks_ptr, scale * _LOG2E, (softcap or 0.0) * _LOG2E, sliding_window or 0


def _variant_meta(softcap: float | None, sinks: torch.Tensor | None) -> dict:
    return dict(HAS_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None)


def decode_meta(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> dict:
    """Compile-time parameters and launch options of the decode kernel."""
    # Tile and warp counts chosen so sm_80/sm_90 builds keep everything in registers (no spills).
    block_d = _pow2_at_least(head_dim, _MIN_DOT)
    return dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=_pow2_at_least(group, _MIN_DOT), BLOCK_D=block_d, TILE=32,
        COMPUTE_DTYPE=_compute_dtype(dtype), DOT_PRECISION=_dot_precision(dtype),
        num_warps=4 if block_d <= 64 else 8,
    )


# ----------------------------------------------------------------------------------------------------
# Prefill: one program per (tile of BLOCK_M queries, sequence, query head), causal over the whole context.


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, sinks_ptr, scale_log2e,
    softcap_log2e, sliding_window,
    stride_q_tok, stride_q_head, stride_out_tok, stride_out_head, stride_bt_seq,
    stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    q_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    local = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    query_pos = context_len - query_len + local
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    row_mask = (local < query_len)[:, None] & dim_mask[None, :]
    tokens = (q_start + local).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_q_tok + q_head * stride_q_head + dims[None, :],
                mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
    m_i, l_i = _softmax_start(sinks_ptr, tl.full([BLOCK_M], q_head, tl.int32), local >= 0, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    # Keys past the tile's last query position are invisible to every row of the tile, and with a window so
    # are keys before its first query's window.
    key_end = tl.minimum(context_len, context_len - query_len + (q_tile + 1) * BLOCK_M)
    first_key = 0
    if sliding_window > 0:
        first_key = tl.maximum(context_len - query_len + q_tile * BLOCK_M - sliding_window + 1, 0)
    for tile_start in range(first_key, key_end, TILE):
        key_pos = tile_start + tl.arange(0, TILE)
        key_in_range = key_pos < context_len
        key_visible = (key_pos[None, :] <= query_pos[:, None]) & key_in_range[None, :]
        if sliding_window > 0:
            key_visible = key_visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, cache_ptr, block_table_row_ptr, key_pos, key_in_range, key_visible,
            q_head // GROUP, dims, dim_mask, scale_log2e, softcap_log2e,
            stride_cache_kv, stride_cache_block, stride_cache_slot, stride_cache_head,
            BLOCK_SIZE, COMPUTE_DTYPE, DOT_PRECISION, HAS_SOFTCAP,
        )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_out_tok + q_head * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill_attention(query, kv_layer, block_tables, cu_seqlens_q, context_lens, scale,
                            max_query_len: int | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's contract (kernels/reference.py). ``max_query_len`` sizes the grid; pass it when known
    to avoid a device-to-host sync."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    query, block_tables = _last_dim_contiguous(query), _last_dim_contiguous(block_tables)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert kv_layer.stride(-1) == 1, "kv cache must be contiguous in head_dim"
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    meta = prefill_meta(kv_layer.dtype, num_q_heads // kv_layer.shape[3], head_dim, kv_layer.shape[2])
    grid = (triton.cdiv(max_query_len, meta["BLOCK_M"]), num_seqs, num_q_heads)
    _paged_prefill_kernel[grid](
        out, query, kv_layer, block_tables, cu_seqlens_q, context_lens,
        *_variant_args(query, scale, sliding_window, softcap, sinks),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        **meta, **_variant_meta(softcap, sinks),
    )
    return out


def prefill_meta(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> dict:
    """Compile-time parameters and launch options of the prefill kernel."""
    # 32-row tiles keep an fp32 head_dim-128 tile set in registers (8 warps, no spills); 16-bit affords 64.
    block_m = 64 if dtype.itemsize <= 2 else 32
    return dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_D=_pow2_at_least(head_dim, _MIN_DOT), TILE=block_m,
        COMPUTE_DTYPE=_compute_dtype(dtype), DOT_PRECISION=_dot_precision(dtype),
        num_warps=8,
    )


# ----------------------------------------------------------------------------------------------------
# Copy-on-write: one program per (block pair, layer × {K, V}).


@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, stride_plane, stride_block,
                        BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    src_base = cache_ptr + plane * stride_plane + src * stride_block
    dst_base = cache_ptr + plane * stride_plane + dst * stride_block
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offsets = start + tl.arange(0, CHUNK)
        mask = offsets < BLOCK_NUMEL
        tl.store(dst_base + offsets, tl.load(src_base + offsets, mask=mask), mask=mask)


def copy_blocks(kv_cache: torch.Tensor, src: BlockIds, dst: BlockIds) -> None:
    src_index = torch.as_tensor(src, dtype=torch.long).to(kv_cache.device)
    if src_index.numel() == 0:
        return
    dst_index = torch.as_tensor(dst, dtype=torch.long).to(kv_cache.device)
    num_layers, _, num_blocks = kv_cache.shape[:3]
    planes = kv_cache.view(num_layers * 2, num_blocks, -1)  # view: the kernel writes through it
    block_numel = planes.shape[2]
    _copy_blocks_kernel[(src_index.numel(), num_layers * 2)](
        planes, src_index, dst_index, planes.stride(0), planes.stride(1),
        **copy_blocks_meta(block_numel),
    )


def copy_blocks_meta(block_numel: int) -> dict:
    return dict(BLOCK_NUMEL=block_numel, CHUNK=min(1024, _pow2_at_least(block_numel)))
