"""Random paged layouts, a naive float64 oracle and its tolerances: shared by kernel tests and micro-benchmark."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedLayout:
    """A layer's pool holding ``context_lens[s]`` tokens per sequence in shuffled, non-contiguous blocks."""

    kv_layer: torch.Tensor    # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [S, width] int32; columns past a sequence's blocks hold padding_block
    context_lens: torch.Tensor  # [S] int32

    @property
    def block_size(self) -> int:
        return self.kv_layer.shape[2]

    def slots(self, seq: int) -> torch.Tensor:
        """Slot of every context position of one sequence, in order."""
        positions = torch.arange(int(self.context_lens[seq]))
        blocks = self.block_tables[seq].long()[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size


def random_layout(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    spare_blocks: int = 3,
    extra_columns: int = 2,
    poison_unused: bool = True,
) -> PagedLayout:
    """Scatter each sequence over randomly chosen blocks of a pool with ``spare_blocks`` unowned blocks.

    With ``poison_unused`` every slot no sequence owns (spare blocks, the tail of last blocks) holds NaN,
    and padding columns point at a spare block: a kernel that reads past a context shows up as NaN.
    """
    blocks_per_seq = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_per_seq) + max(spare_blocks, 1)
    order = torch.randperm(num_blocks, generator=generator)
    padding_block = int(order[-1])
    width = max(blocks_per_seq, default=0) + extra_columns
    block_tables = torch.full((len(context_lens), width), padding_block, dtype=torch.int32)
    start = 0
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = order[start:start + count].to(torch.int32)
        start += count
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    fill = float("nan") if poison_unused else 0.0
    kv_layer = torch.full(shape, fill, dtype=dtype)
    layout = PagedLayout(kv_layer, block_tables, torch.tensor(context_lens, dtype=torch.int32))
    flat = kv_layer.view(2, -1, num_kv_heads, head_dim)
    for seq in range(len(context_lens)):
        slots = layout.slots(seq)
        flat[:, slots] = torch.randn(2, len(slots), num_kv_heads, head_dim, generator=generator).to(dtype)
    return layout


def naive_attention(
    query: torch.Tensor, layout: PagedLayout, query_positions: list[torch.Tensor], scale: float,
    sliding_window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 attention with a plain softmax, one sequence at a time, reading the pool via the block tables.

    ``query`` is ``[T, Hq, D]`` with sequence ``s`` owning the next ``len(query_positions[s])`` rows; each row
    attends causally to keys ``0 ..`` its position (the last ``sliding_window`` of them with a window), with
    ``softcap`` and ``sinks`` as kernels/variants.py defines them. Returns ``[T, Hq, D]`` in float64.
    """
    num_q_heads, num_kv_heads = query.shape[1], layout.kv_layer.shape[3]
    kv_head_of = torch.arange(num_q_heads) // (num_q_heads // num_kv_heads)
    flat = layout.kv_layer.view(2, -1, num_kv_heads, layout.kv_layer.shape[4]).double()
    outputs = []
    row = 0
    for seq, positions in enumerate(query_positions):
        keys, values = flat[:, layout.slots(seq)][:, :, kv_head_of].transpose(1, 2)  # [Hq, ctx, D] each
        q = query[row:row + len(positions)].double().transpose(0, 1)  # [Hq, n, D]
        scores = q @ keys.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        distance = positions[:, None] - torch.arange(keys.shape[1])[None, :]
        visible = (distance >= 0) & (distance < (sliding_window or keys.shape[1] + 1))
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:   # one more logit per head, whose value is zero
            sink_column = sinks.double().view(-1, 1, 1).expand(-1, len(positions), 1)
            weights = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1)
        outputs.append((weights @ values).transpose(0, 1))
        row += len(positions)
    return torch.cat(outputs) if outputs else torch.empty(query.shape, dtype=torch.float64)


POISON_BLOCK = 2**30


def poison_out_of_window(layout: PagedLayout, first_query_positions: list[int], sliding_window: int) -> None:
    """Point every block-table entry of a block that lies wholly before the window of a sequence's first query at
    a block id far outside the pool, as an engine that freed those blocks may: a kernel reading one fails."""
    for seq, first_query in enumerate(first_query_positions):
        first_block = max(0, first_query - sliding_window + 1) // layout.block_size
        layout.block_tables[seq, :first_block] = POISON_BLOCK


# Largest absolute error against the float64 oracle: fp32 kernels must agree to rounding; bf16 ones are allowed
# about two bf16 ulps at the outputs' magnitude (softmax weights are kept in fp32 by every kernel).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert not torch.isnan(out).any(), "NaN in kernel output"
    error = (out.double() - expected).abs().max().item()
    assert error < TOLERANCE[dtype], f"max abs error {error}"


def make_query(num_tokens: int, num_q_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    # Built head-major then transposed: the kernels must not assume a contiguous query.
    return torch.randn(num_q_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)
