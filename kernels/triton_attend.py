"""What the Triton attention kernels share: the inner loop over one tile of keys, the online softmax's start,
the layer variant's arguments, and the helpers that pick dtypes and power-of-two sizes.

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

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every dimension >= 16
_TORCH_TO_TRITON = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def compute_dtype(dtype: torch.dtype) -> tl.dtype:
    # Whether the kernels were built for the interpreter was fixed when this module was imported.
    return tl.float32 if isinstance(attend_tile, InterpretedFunction) else _TORCH_TO_TRITON[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    # Default fp32 dots on NVIDIA round to tf32 (~1e-3 error); ask for full precision. Ignored for 16-bit.
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------------
# The inner loop: one tile of keys/values folded into a running (max, sum, accumulator).


@triton.jit
def attend_tile(
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
def softmax_start(sinks_ptr, q_heads, row_valid, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The online softmax's running (max, sum) before any key: nothing, or each row's sink (e^0 = 1 of itself)."""
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + q_heads, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([ROWS], 1.0, tl.float32)
    else:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
    return m_i, l_i


def variant_args(query: torch.Tensor, scale: float, sliding_window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None) -> tuple:
    """sinks_ptr (the query stands in when there are none: never read), scale and softcap in the exp2 domain,
    and the window (0: none)."""
    sinks_ptr = query if sinks is None else sinks.detach().to(device=query.device, dtype=torch.float32).contiguous()
    return sinks_ptr, scale * LOG2E, (softcap or 0.0) * LOG2E, sliding_window or 0


def variant_meta(softcap: float | None, sinks: torch.Tensor | None) -> dict:
    return dict(HAS_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None)
