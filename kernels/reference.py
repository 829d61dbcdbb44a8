"""Paged attention in plain torch: the CPU production path, and the oracle for the Triton kernels.

Each attention call may carry its layer's variant: a sliding window, soft-capped logits, attention sinks
(kernels/variants.py defines them; SDPA serves where it can express the variant, the written-out form elsewhere).

Cache layout (one layer): ``kv_layer[2, num_blocks, block_size, num_kv_heads, head_dim]``; index 0 holds
keys, 1 values. Token slot ``s`` lives at block ``s // block_size``, offset ``s % block_size``.

On CPU attention is bound by moving K/V out of the scattered blocks, not by arithmetic, so:

- what follows from the block tables alone (row indices, masks) is a plan, built on the first layer of a step
  and reused by the others, which pass equal tables;
- large scratch tensors come from a reused per-thread workspace (kernels/workspace.py: a fresh multi-megabyte
  allocation per layer costs more in page faults than the copy itself);
- no slot past a context enters the arithmetic (decode points padding at the context's last token and masks
  it out; prefill slices each context out of its gathered blocks), so whatever the pool holds there (stale
  data, even NaN) never reaches the output;
- a 16-bit pool attends in float32 (``_compute_dtype``): scores, softmax and the weighted sum of values, with
  the output rounded once, as the C++ kernels do. SDPA on bf16 inputs rounds the softmax weights to bf16
  before summing the values (so did embedding_bag's bf16 weights here): against a float64 oracle that was
  1.2-1.5x the error of a correctly rounded output, and a bf16 model's tokens drift from fp32's sooner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvscope.kernels.variants import explicit_attention, first_visible, soft_cap, window_mask
from kvscope.kernels.workspace import _plans, _workspace

BlockIds = torch.Tensor | Sequence[int]


def clear_workspace() -> None:
    """Drop this thread's scratch buffers and plans (sized for the largest batch seen)."""
    _workspace.buffers.clear()
    _plans.entries.clear()


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into slots ``slot_mapping[T]`` of ``kv_layer``, in place."""
    num_kv_heads, head_dim = kv_layer.shape[-2:]
    # view (not reshape): a copy here would silently drop the writes.
    slots = kv_layer.view(2, -1, num_kv_heads, head_dim)
    slot_mapping = slot_mapping.to(device=kv_layer.device, dtype=torch.long)
    slots[0].index_copy_(0, slot_mapping, key.to(kv_layer.dtype))
    slots[1].index_copy_(0, slot_mapping, value.to(kv_layer.dtype))


def _slots(tables: torch.Tensor, seqs: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of context position ``positions[i, j]`` of sequence ``seqs[i]``."""
    blocks = tables.reshape(-1)[seqs[:, None] * tables.shape[1] + positions // block_size]
    return blocks * block_size + positions % block_size


# Decode. A batch whose padded size is small takes one gather of keys and values and one SDPA call: the fewest
# ops. Larger ones are cut into tiles of _TILE keys per sequence, only each sequence's last tile padded, so mixed
# lengths cost about what their real tokens cost (padding to the longest context, even in length buckets, moved
# up to twice as many keys). Keys are gathered head-major, about _CHUNK_KEYS (of all sequences) at a time, so
# each (tile, kv head) is one contiguous matmul over keys still in cache. Values are never gathered: embedding_bag
# sums the weighted value rows straight out of the pool, one bag per (sequence, query head). Against the former
# length buckets + zero-fill + SDPA, at batch 64 and contexts 56..552: 1.9x faster in float32, 1.5x in bf16.
_PADDED_MAX_KEYS = 512
_TILE = 32
_CHUNK_KEYS = 8192


def paged_decode_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (``[B, Hq, D]``) at position ``context_lens[b] - 1`` (>= 0), attending to its
    cached tokens: all of them, or the last ``sliding_window``. ``softcap`` and ``sinks`` ([Hq] logits) as
    kernels/variants.py defines them; block-table entries before the window are never read."""
    num_seqs, num_q_heads, _ = query.shape
    if num_seqs == 0:
        return query.new_empty(query.shape)
    key = (tuple(kv_layer.shape[1:]), kv_layer.dtype, kv_layer.device, num_q_heads)
    # One plan per window: a model alternating sliding and full layers keeps both for the whole step.
    plan = _plans.get(_plan_kind("decode", sliding_window), key, (block_tables, context_lens),
                      lambda: _decode_plan(block_tables, context_lens, kv_layer, num_q_heads, sliding_window))
    return plan.attend(query, kv_layer, scale, softcap, sinks)


def _plan_kind(kind: str, sliding_window: int | None) -> str:
    return kind if sliding_window is None else f"{kind}/{sliding_window}"


def _decode_plan(block_tables, context_lens, kv_layer, num_q_heads, sliding_window) -> _PaddedDecode | _TiledDecode:
    lens = context_lens.to(device=kv_layer.device, dtype=torch.long)
    first = first_visible(lens - 1, sliding_window)
    tables = block_tables.to(device=kv_layer.device, dtype=torch.long)
    if lens.numel() * int((lens - first).max()) <= _PADDED_MAX_KEYS:
        return _PaddedDecode(first, lens, tables, kv_layer)
    return _TiledDecode(first, lens, tables, kv_layer, num_q_heads)


class _PaddedDecode:
    """Every context padded to the longest: one gather of keys and values, one SDPA call."""

    def __init__(self, first: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor, kv_layer: torch.Tensor):
        _, num_blocks, block_size = kv_layer.shape[:3]
        spans = lens - first
        self.span = int(spans.max())
        positions = first[:, None] + torch.arange(self.span, device=lens.device)
        last = (lens - 1)[:, None]
        self.mask = None if bool((spans == self.span).all()) else (positions <= last)[:, None, None, :]
        seqs = torch.arange(lens.numel(), device=lens.device)
        slots = _slots(tables, seqs, torch.minimum(positions, last), block_size)
        self.rows = torch.cat((slots, slots + num_blocks * block_size)).view(-1)  # keys, then values

    def attend(self, query: torch.Tensor, kv_layer: torch.Tensor, scale: float, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_seqs, num_q_heads, head_dim = query.shape
        num_kv_heads = kv_layer.shape[3]
        slots = kv_layer.view(-1, num_kv_heads * head_dim)
        kv = _workspace.take("padded", (self.rows.numel(), slots.shape[1]), kv_layer.dtype, kv_layer.device)
        torch.index_select(slots, 0, self.rows, out=kv)
        kv = _upcast("padded_upcast", kv).view(2, num_seqs, self.span, num_kv_heads, head_dim).transpose(2, 3)
        # The query heads sharing a kv head act as a short query sequence over the same keys: plain MHA shapes,
        # so SDPA needs neither enable_gqa nor a repeat_interleave copy of K/V.
        group = num_q_heads // num_kv_heads
        grouped = query.to(kv.dtype).reshape(num_seqs, num_kv_heads, group, head_dim)
        if softcap or sinks is not None:
            out = explicit_attention(grouped, kv[0], kv[1], self.mask, scale, softcap,
                                     None if sinks is None else sinks.view(num_kv_heads, group, 1))
        else:
            out = F.scaled_dot_product_attention(grouped, kv[0], kv[1], attn_mask=self.mask, scale=scale)
        return out.reshape(num_seqs, num_q_heads, head_dim).to(query.dtype)


class _TiledDecode:
    """Row indices of every tile's keys (its values' follow them in the pool), and the mask of the padded
    tile tails."""

    def __init__(self, first: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor, kv_layer: torch.Tensor,
                 num_q_heads: int):
        _, num_blocks, block_size, num_kv_heads, _ = kv_layer.shape
        device = lens.device
        self.num_seqs, self.num_q_heads = lens.numel(), num_q_heads
        tiles_per_seq = (lens - first + _TILE - 1) // _TILE
        self.seq_of_tile = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), tiles_per_seq)
        first_tile = tiles_per_seq.cumsum(0) - tiles_per_seq
        tile_in_seq = torch.arange(self.seq_of_tile.numel(), device=device) - first_tile[self.seq_of_tile]
        positions = (first[self.seq_of_tile, None] + tile_in_seq[:, None] * _TILE
                     + torch.arange(_TILE, device=device))
        last = (lens - 1)[self.seq_of_tile, None]
        key_mask = torch.zeros(positions.shape, dtype=_compute_dtype(kv_layer.dtype), device=device)
        key_mask.masked_fill_(positions > last, float("-inf"))
        self.key_mask = key_mask.repeat_interleave(num_kv_heads, 0)[:, None]  # [tiles * Hkv, 1, _TILE]
        slot_rows = _slots(tables, self.seq_of_tile, torch.minimum(positions, last), block_size) * num_kv_heads
        heads = torch.arange(num_kv_heads, device=device)
        self.key_rows = (slot_rows[:, None, :] + heads[:, None]).view(-1)  # tile by tile, head-major
        self.values_offset = num_blocks * block_size * num_kv_heads  # values follow the keys in the pool's rows

    def attend(self, query: torch.Tensor, kv_layer: torch.Tensor, scale: float, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        head_dim = query.shape[2]
        rows = kv_layer.view(-1, head_dim)  # one row per (slot, kv head), keys first
        scores = self._scores(query, rows, kv_layer.shape[3], scale)
        if softcap:
            scores.copy_(soft_cap(scores, softcap))
        self._softmax(scores, sinks)
        return self._weighted_values(scores, rows, kv_layer.shape[3]).to(query.dtype)

    def _scores(self, query: torch.Tensor, rows: torch.Tensor, num_kv_heads: int, scale: float) -> torch.Tensor:
        """Scaled query-key products, ``-inf`` past each context: ``[tiles, Hq, _TILE]``, in the workspace."""
        head_dim = query.shape[2]
        dtype = _compute_dtype(rows.dtype)
        num_rows = self.seq_of_tile.numel() * num_kv_heads  # (tile, kv head) pairs
        queries = query.to(dtype).index_select(0, self.seq_of_tile).view(num_rows, -1, head_dim)
        scores = _workspace.take("scores", (num_rows, queries.shape[1], _TILE), dtype, rows.device)
        for start, end, keys in self._tiles(rows, self.key_rows, num_kv_heads):
            torch.baddbmm(self.key_mask[start:end], queries[start:end], keys.transpose(1, 2), alpha=scale,
                          out=scores[start:end])
        return scores.view(self.seq_of_tile.numel(), self.num_q_heads, _TILE)

    def _weighted_values(self, weights: torch.Tensor, rows: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """Each sequence's values summed with its softmax weights (``[tiles, Hq, _TILE]``): ``[B, Hq, D]``."""
        head_dim = rows.shape[1]
        num_rows = self.seq_of_tile.numel() * num_kv_heads
        weights = weights.view(num_rows, -1, _TILE)
        partial = _workspace.take("partial", (num_rows, weights.shape[1], head_dim), weights.dtype, rows.device)
        for start, end, values in self._tiles(rows, self.key_rows + self.values_offset, num_kv_heads):
            torch.bmm(weights[start:end], values, out=partial[start:end])
        out = partial.new_zeros((self.num_seqs, self.num_q_heads, head_dim))
        return out.index_add_(0, self.seq_of_tile, partial.view(-1, self.num_q_heads, head_dim))

    @staticmethod
    def _tiles(rows: torch.Tensor, tile_rows: torch.Tensor, num_kv_heads: int):
        """(start, end, rows) for chunks of about _CHUNK_KEYS of the (tile, kv head) pairs' rows: gathered,
        in the compute dtype, ``[end - start, _TILE, D]``, in the workspace (the last chunk's stay there)."""
        head_dim = rows.shape[1]
        num_rows = tile_rows.numel() // _TILE
        step = max(1, _CHUNK_KEYS // _TILE) * num_kv_heads
        for start in range(0, num_rows, step):
            end = min(start + step, num_rows)
            picked = tile_rows[start * _TILE:end * _TILE]
            gathered = _workspace.take("tile_rows", (picked.numel(), head_dim), rows.dtype, rows.device)
            torch.index_select(rows, 0, picked, out=gathered)
            yield start, end, _upcast("tile_rows_upcast", gathered).view(end - start, _TILE, head_dim)

    def _softmax(self, scores: torch.Tensor, sinks: torch.Tensor | None) -> None:
        """Softmax in place over all the tiles of each sequence, per query head (sinks in the denominator)."""
        seq_of_tile = self.seq_of_tile
        shape = (self.num_seqs, self.num_q_heads)
        if sinks is None:
            seq_max = scores.new_full(shape, float("-inf"))
        else:
            seq_max = sinks.to(scores.dtype).expand(shape).clone()
        seq_max.scatter_reduce_(0, seq_of_tile[:, None].expand(-1, self.num_q_heads), scores.amax(-1), "amax")
        scores.sub_(seq_max[seq_of_tile, :, None]).exp_()
        seq_sum = scores.new_zeros(shape) if sinks is None else (sinks.to(scores.dtype) - seq_max).exp()
        seq_sum.index_add_(0, seq_of_tile, scores.sum(-1))
        scores.div_(seq_sum[seq_of_tile, :, None])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What attention over a pool of ``dtype`` computes in: float32 for 16-bit pools (see the module's doc)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _upcast(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in its compute dtype: itself if already there, else a copy in the workspace."""
    dtype = _compute_dtype(tensor.dtype)
    if tensor.dtype == dtype:
        return tensor
    return _workspace.take(name, tensor.shape, dtype, tensor.device).copy_(tensor)


def paged_prefill_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal chunks of queries (``[T, Hq, D]``, flattened over sequences) over their cached context.

    Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``; its ``i``-th query sits at position
    ``p = context_lens[s] - q_len + i`` and sees keys ``0 .. p`` (``p - sliding_window + 1 .. p`` with a window),
    all already in the pool; block-table entries of blocks before the chunk's first query's window are never
    read. ``softcap`` and ``sinks`` as kernels/variants.py defines them. ``max_query_len`` is unused here (the
    Triton path takes it to avoid a device sync).
    """
    key = (tuple(kv_layer.shape[1:]), kv_layer.dtype, kv_layer.device)
    plan = _plans.get(_plan_kind("prefill", sliding_window), key, (block_tables, cu_seqlens_q, context_lens),
                      lambda: _PrefillPlan(block_tables, cu_seqlens_q, context_lens, kv_layer, sliding_window))
    return plan.attend(query, kv_layer, scale, softcap, sinks)


class _PrefillPlan:
    """One gather of the blocks every sequence's chunk can see; per sequence, its query rows, keys and mask."""

    def __init__(self, block_tables, cu_seqlens_q, context_lens, kv_layer, sliding_window=None) -> None:
        block_size, device = kv_layer.shape[2], kv_layer.device
        starts = cu_seqlens_q.tolist()
        self.seqs: list[tuple[int, int, int, int, torch.Tensor | None]] = []
        blocks, num_gathered = [], 0
        for seq, context_len in enumerate(context_lens.tolist()):
            q_start, q_end = starts[seq], starts[seq + 1]
            if q_end == q_start:
                continue
            first_query = context_len - (q_end - q_start)
            first_block = first_visible(first_query, sliding_window) // block_size
            seq_blocks = -(-context_len // block_size)
            blocks.append(block_tables[seq, first_block:seq_blocks])
            key_start = first_block * block_size
            # torch's is_causal aligns the diagonal top-left: right only for a whole prompt without a window.
            mask = None if first_query == 0 and sliding_window is None else window_mask(
                torch.arange(first_query, context_len, device=device),
                torch.arange(key_start, context_len, device=device), sliding_window)
            self.seqs.append((q_start, q_end, num_gathered * block_size, context_len - key_start, mask))
            num_gathered += seq_blocks - first_block
        block_ids = torch.cat(blocks).to(device=device, dtype=torch.long) if blocks else None
        # Rows of the pool viewed as [2 * num_blocks, one block]: keys, then values.
        self.rows = None if block_ids is None else torch.cat((block_ids, block_ids + kv_layer.shape[1]))

    def attend(self, query: torch.Tensor, kv_layer: torch.Tensor, scale: float, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.rows is None:
            return torch.empty_like(query)
        num_blocks, num_kv_heads, head_dim = kv_layer.shape[1], kv_layer.shape[3], kv_layer.shape[4]
        blocks = kv_layer.view(2 * num_blocks, -1)
        gathered = _workspace.take("blocks", (self.rows.numel(), blocks.shape[1]), kv_layer.dtype, kv_layer.device)
        torch.index_select(blocks, 0, self.rows, out=gathered)
        tokens = _upcast("blocks_upcast", gathered).view(2, -1, num_kv_heads, head_dim)  # [2, slots, Hkv, D]
        queries = query.to(tokens.dtype)
        group = query.shape[1] // num_kv_heads
        outs = []
        for q_start, q_end, key_start, num_keys, mask in self.seqs:
            keys, values = tokens[:, key_start:key_start + num_keys].transpose(1, 2)  # [Hkv, keys, D] each
            q = queries[q_start:q_end].transpose(0, 1)  # [Hq, n, D]
            if softcap or sinks is not None:
                if mask is None:
                    mask = torch.ones(q.shape[1], num_keys, dtype=torch.bool, device=q.device).tril()
                out = explicit_attention(q, keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0),
                                         mask, scale, softcap, None if sinks is None else sinks.view(-1, 1, 1))
            else:
                out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                                     is_causal=mask is None, scale=scale, enable_gqa=True)[0]
            outs.append(out.transpose(0, 1))
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).to(query.dtype)


def _block_index(ids: BlockIds, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long).to(device)


def copy_blocks(kv_cache: torch.Tensor, src: BlockIds, dst: BlockIds) -> None:
    """Copy-on-write: block ``src[i]`` → ``dst[i]`` in every layer, K and V (``kv_cache[L, 2, N, ...]``)."""
    src_index = _block_index(src, kv_cache.device)
    if src_index.numel() == 0:
        return
    dst_index = _block_index(dst, kv_cache.device)
    kv_cache.index_copy_(2, dst_index, kv_cache.index_select(2, src_index))


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src_ids: BlockIds, dst_ids: BlockIds
) -> None:
    """Move blocks ``src_ids[i]`` of one whole-model cache to ``dst_ids[i]`` of another, across devices.

    Gathers on the source device, crosses the bus once, scatters on the destination device.
    """
    src_index = _block_index(src_ids, src_cache.device)
    if src_index.numel() == 0:
        return
    dst_index = _block_index(dst_ids, dst_cache.device)
    moved = src_cache.index_select(2, src_index).to(dst_cache.device)
    dst_cache.index_copy_(2, dst_index, moved)
