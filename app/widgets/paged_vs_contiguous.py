"""What a contiguous allocator would reserve for the live requests, against what paging holds.

Contiguous: every live sequence reserves max_model_len slots (rounded to blocks),
whatever it has written. Paged: the distinct blocks in use. Waste is the share of
reserved slots that hold no token. With KV-cache groups (a sliding-window model) a
block holds one group's layers, so slots are counted per group on both sides: a
contiguous allocator would reserve max_model_len in every group, and a token a
sequence holds counts once in each group that keeps it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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


def compare_allocations(snapshot: CacheSnapshot, max_model_len: int) -> AllocationComparison:
    block_size = snapshot.block_size
    num_groups = len(snapshot.kv_cache_groups) or 1
    slots_per_sequence = -(-max_model_len // block_size) * block_size * num_groups
    tables = [table for view in snapshot.requests for table in view.block_tables if table]
    # Every table's tokens in one gather and one segmented sum (this runs every frame).
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    entries = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lengths.sum()))
    per_table = np.add.reduceat(snapshot.block_fill.astype(np.int64)[entries], np.cumsum(lengths) - lengths) \
        if tables else np.zeros(0, dtype=np.int64)
    num_tokens = int(per_table.sum())
    if snapshot.allocator == "contiguous":
        # The engine itself reserves whole rows; paging would hold each sequence's filled blocks only.
        paged_slots = int((-(-per_table // block_size) * block_size).sum())
        paged_tokens = num_tokens
    else:
        used = snapshot.block_state == BLOCK_USED
        paged_slots = int(used.sum()) * block_size
        paged_tokens = int(snapshot.block_fill[used].astype(np.int64).sum())
    return AllocationComparison(len(tables), num_tokens, len(tables) * slots_per_sequence,
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

    def show_snapshot(self, snapshot: CacheSnapshot, max_model_len: int) -> None:
        comparison = compare_allocations(snapshot, max_model_len)
        if comparison != self.comparison:
            self.comparison = comparison
            text = describe_comparison(comparison, snapshot.allocator, snapshot.block_size)
            self.show(text)
