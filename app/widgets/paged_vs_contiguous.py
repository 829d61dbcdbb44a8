"""What a contiguous allocator would reserve for the live requests, against what paging holds.

Contiguous: every live sequence reserves max_model_len slots (rounded to blocks),
whatever it has written. Paged: the distinct blocks in use. Waste is the share of
reserved slots that hold no token. With KV-cache groups (a sliding-window model) a
block holds one group's layers, so slots are counted per group on both sides: a
contiguous allocator would reserve max_model_len in every group, and a token a
sequence holds counts once in each group that keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvscope.app.widgets.formatting import bar, percent
from kvscope.app.widgets.line_panel import LinePanel
from kvscope.engine.outputs import BLOCK_USED, CacheSnapshot

BAR_WIDTH = 10


@dataclass(frozen=True)
class AllocationComparison:
    num_sequences: int
    num_tokens: int              # tokens the live sequences hold, per group (a shared block counts per sequence)
    contiguous_slots: int
    paged_slots: int
    paged_tokens: int            # tokens in the distinct blocks in use (a shared block counts once)
    slots_per_sequence: int = 0  # what contiguous reserves for each: max_model_len, rounded up to blocks, per group
    num_groups: int = 1

    @property
    def contiguous_waste(self) -> float:
        return 1 - self.num_tokens / self.contiguous_slots if self.contiguous_slots else 0.0

    @property
    def paged_waste(self) -> float:
        return 1 - self.paged_tokens / self.paged_slots if self.paged_slots else 0.0


class PoolTotals(NamedTuple):
    """What paging holds now: the blocks in use and the tokens in them (a shared block counts once), and every
    block's fill (read for the requests with several tables)."""

    used_blocks: int
    used_tokens: int
    fill: np.ndarray


def pool_totals(snapshot: CacheSnapshot) -> PoolTotals:
    """The totals read from the whole arrays: O(blocks), and it builds them if the snapshot has only changes. The
    live window passes the block map's running totals instead (MapAggregates.pool_totals)."""
    used = snapshot.block_state == BLOCK_USED
    fill = snapshot.block_fill
    return PoolTotals(int(used.sum()), int(fill[used].astype(np.int64).sum()), fill)


def table_tokens(snapshot: CacheSnapshot, fill: np.ndarray | None = None) -> np.ndarray:
    """int64 tokens each live sequence's table holds, one entry per table (a block shared by two tables counts in
    each). A request with one table holds ``used_slots`` tokens in it (the view's own count); only the tables of
    requests with several (samples, KV-cache groups) are summed block by block, so a frame costs O(requests).
    ``fill``: every block's fill, when the caller keeps it (else the snapshot's)."""
    tokens: list[int] = []
    for view in snapshot.requests:
        tables = view.block_tables
        if len(tables) == 1 and not view.group_block_tables:
            if tables[0]:
                tokens.append(view.used_slots)
            continue
        for table in tables:
            if table:
                if fill is None:
                    fill = snapshot.block_fill
                tokens.append(int(fill[np.fromiter(table, dtype=np.int64, count=len(table))].sum(dtype=np.int64)))
    return np.array(tokens, dtype=np.int64)


def compare_allocations(snapshot: CacheSnapshot, max_model_len: int,
                        totals: PoolTotals | None = None) -> AllocationComparison:
    """``totals``: the pool's, when the caller keeps them (else read from the whole arrays)."""
    block_size = snapshot.block_size
    num_groups = len(snapshot.kv_cache_groups) or 1
    slots_per_sequence = -(-max_model_len // block_size) * block_size * num_groups
    per_table = table_tokens(snapshot, totals.fill if totals is not None else None)
    num_tokens = int(per_table.sum())
    if snapshot.allocator == "contiguous":
        # The engine itself reserves whole rows; paging would hold each sequence's filled blocks only.
        paged_slots = int((-(-per_table // block_size) * block_size).sum())
        paged_tokens = num_tokens
    else:
        totals = totals if totals is not None else pool_totals(snapshot)
        paged_slots = totals.used_blocks * block_size
        paged_tokens = totals.used_tokens
    return AllocationComparison(per_table.size, num_tokens, per_table.size * slots_per_sequence,
                                paged_slots, paged_tokens, slots_per_sequence, num_groups)


def describe_comparison(cmp: AllocationComparison, allocator: str, block_size: int) -> str:
    """Six short lines (the panel is about forty columns wide in a 120-column window)."""
    def role(name: str) -> str:
        return "[b]this engine[/b]" if allocator == name else "[dim]what-if[/]"

    # With KV-cache groups a held token counts once per group that keeps it: slots, and the reservation's factors.
    held = "tokens" if cmp.num_groups == 1 else "slots"
    groups = "" if cmp.num_groups == 1 else f"{cmp.num_groups}×"
    hold = "s hold" if cmp.num_sequences != 1 else " holds"
    lines = [
        f"{cmp.num_sequences:,} sequence{hold} {cmp.num_tokens:,} {held}",
        f"contiguous ({role('contiguous')}): {cmp.contiguous_slots:,} slots",
        f"  {cmp.num_sequences:,}×{groups}{cmp.slots_per_sequence // cmp.num_groups:,} · "
        f"{percent(cmp.contiguous_waste).strip()} empty "
        f"[$error]{bar(cmp.contiguous_waste, BAR_WIDTH)}[/]",
        f"paged ({role('paged')}): {cmp.paged_slots:,} slots",
        f"  {cmp.paged_slots // block_size:,} blocks · {percent(cmp.paged_waste).strip()} empty "
        f"[$success]{bar(cmp.paged_waste, BAR_WIDTH)}[/]",
    ]
    if cmp.paged_slots:
        lines.append(f"[dim]contiguous: {cmp.contiguous_slots / cmp.paged_slots:.1f}x paging's slots[/]")
    return "\n".join(lines)


class PagedVsContiguous(LinePanel):
    PLACEHOLDER = "no live requests yet"
    comparison: AllocationComparison | None = None

    def show_snapshot(self, snapshot: CacheSnapshot, max_model_len: int, totals: PoolTotals | None = None) -> None:
        comparison = compare_allocations(snapshot, max_model_len, totals)
        if comparison != self.comparison:
            self.comparison = comparison
            text = describe_comparison(comparison, snapshot.allocator, snapshot.block_size)
            self.show(text)
