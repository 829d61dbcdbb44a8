"""Details of the block(s) under the map's cursor: state, ref count, fill, prefix hash, who points at it."""

from __future__ import annotations

from collections import Counter

from textual.content import Content

from app.widgets.steady_static import SteadyStatic
from engine.outputs import BLOCK_CACHED, BLOCK_USED, CacheSnapshot
from themes.palette import NUM_OWNER_COLOURS, owner_variable

_STATE_NAMES = {BLOCK_USED: "in use", BLOCK_CACHED: "cached prefix, free"}
HINT = "Move the cursor over the map (arrows or mouse) to inspect a block; Enter selects its request."


def describe_block(snapshot: CacheSnapshot, block: int) -> Content:
    state = int(snapshot.block_state[block])
    parts = [f"[b]Block {block}[/b]", _STATE_NAMES.get(state, "free")]
    if state == BLOCK_USED:
        parts.append(f"ref {int(snapshot.ref_counts[block])}")
        parts.append(f"{int(snapshot.block_fill[block])}/{snapshot.block_size} slots")
    block_hash = int(snapshot.block_hashes[block])
    parts.append(f"prefix hash {block_hash:016x}" if block_hash else "no prefix hash")
    head = Content.from_markup(" · ".join(parts))
    owners = snapshot.owners(block)
    if not owners:
        return head
    colour = {view.request_id: view.arrival_index % NUM_OWNER_COLOURS for view in snapshot.requests}
    tables = [
        Content.from_markup(f"[${owner_variable(colour[rid])}]$rid[/]", rid=rid)
        + Content(f"{'' if sample == 0 else f'[s{sample}]'} logical {logical}")
        for rid, sample, logical in owners
    ]
    return Content("\n").join([head, Content(", ").join(tables)])


def describe_cell(snapshot: CacheSnapshot, first: int, last: int) -> Content:
    """One block: describe it. Several (an aggregated cell): count their states, then the first in use."""
    if first == last:
        return describe_block(snapshot, first)
    states = Counter(int(s) for s in snapshot.block_state[first:last + 1])
    summary = Content(f"Blocks {first}–{last} (one cell): {states[BLOCK_USED]} in use, "
                      f"{states[BLOCK_CACHED]} cached, "
                      f"{last - first + 1 - states[BLOCK_USED] - states[BLOCK_CACHED]} free")
    for block in range(first, last + 1):
        if snapshot.block_state[block] == BLOCK_USED:
            return Content("\n").join([summary, describe_block(snapshot, block)])
    return summary


class BlockInspector(SteadyStatic):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(HINT, id=id, classes=classes)
        self.cell: tuple[int, int] | None = None
        self._snapshot: CacheSnapshot | None = None

    def inspect(self, first: int, last: int) -> None:
        self.cell = (first, last)
        self._redraw()

    def show_snapshot(self, snapshot: CacheSnapshot) -> None:
        self._snapshot = snapshot
        self._redraw()

    def _redraw(self) -> None:
        if self._snapshot is None or self.cell is None:
            return
        first, last = self.cell
        if last >= self._snapshot.num_blocks:
            self.show(Content(HINT))
            return
        self.show(describe_cell(self._snapshot, first, last))
