"""What a contiguous allocator would reserve for the live requests, against what paging holds.

Contiguous: every live sequence reserves max_model_len slots (rounded to blocks),
whatever it has written. Paged: the distinct blocks in use. Waste is the share of
reserved slots that hold no token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from textual.content import Content

from app.widgets.formatting import bar, percent
from app.widgets.steady_static import SteadyStatic
from engine.outputs import BLOCK_USED, CacheSnapshot

BAR_WIDTH = 14


@dataclass(frozen=True)
class AllocationComparison:
    num_sequences: int
    num_tokens: int              # tokens the live sequences hold (a shared block counts per sequence)
    contiguous_slots: int
    paged_slots: int
    paged_tokens: int            # tokens in the distinct blocks in use (a shared block counts once)

    @property
    def contiguous_waste(self) -> float:
        return 1 - self.num_tokens / self.contiguous_slots if self.contiguous_slots else 0.0

    @property
    def paged_waste(self) -> float:
        return 1 - self.paged_tokens / self.paged_slots if self.paged_slots else 0.0


def compare_allocations(snapshot: CacheSnapshot, max_model_len: int) -> AllocationComparison:
    block_size = snapshot.block_size
    slots_per_sequence = -(-max_model_len // block_size) * block_size
    fill = snapshot.block_fill.astype(np.int64)
    tables = [table for view in snapshot.requests for table in view.block_tables if table]
    num_tokens = sum(int(fill[list(table)].sum()) for table in tables)
    if snapshot.allocator == "contiguous":
        # The engine itself reserves whole rows; paging would hold each sequence's filled blocks only.
        paged_slots = sum(-(-int(fill[list(t)].sum()) // block_size) * block_size for t in tables)
        paged_tokens = num_tokens
    else:
        used = snapshot.block_state == BLOCK_USED
        paged_slots = int(used.sum()) * block_size
        paged_tokens = int(fill[used].sum())
    return AllocationComparison(len(tables), num_tokens, len(tables) * slots_per_sequence,
                                paged_slots, paged_tokens)


def describe_comparison(cmp: AllocationComparison, allocator: str, max_model_len: int) -> str:
    def role(name: str) -> str:
        return "[b]this engine[/b]" if allocator == name else "[dim]what-if[/]"

    lines = [
        f"{cmp.num_sequences:,} live sequences · {cmp.num_tokens:,} tokens",
        f"contiguous ({role('contiguous')}) {cmp.contiguous_slots:,} slots",
        f"  {percent(cmp.contiguous_waste)} empty [$error]{bar(cmp.contiguous_waste, BAR_WIDTH)}[/]",
        f"paged ({role('paged')}) {cmp.paged_slots:,} slots",
        f"  {percent(cmp.paged_waste)} empty [$success]{bar(cmp.paged_waste, BAR_WIDTH)}[/]",
    ]
    ratio = f"{cmp.contiguous_slots / cmp.paged_slots:.1f}x" if cmp.paged_slots else "–"
    lines.append(f"[dim]{max_model_len:,} per sequence: {ratio} paging's memory[/]")
    return "\n".join(lines)


class PagedVsContiguous(SteadyStatic):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__("no live requests yet", id=id, classes=classes)
        self.comparison: AllocationComparison | None = None

    def show_snapshot(self, snapshot: CacheSnapshot, max_model_len: int) -> None:
        comparison = compare_allocations(snapshot, max_model_len)
        if comparison != self.comparison:
            self.comparison = comparison
            text = describe_comparison(comparison, snapshot.allocator, max_model_len)
            self.show(Content.from_markup(text))
