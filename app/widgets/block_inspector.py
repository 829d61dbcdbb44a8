"""Details of the block(s) under the map's cursor: state, ref count, fill, prefix hash, who points at it."""

from __future__ import annotations

from collections import Counter

from textual.content import Content

from kvscope.app.widgets.line_panel import SnapshotPanel
from kvscope.engine.outputs import BLOCK_CACHED, BLOCK_USED, CacheSnapshot
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable

_STATE_NAMES = {BLOCK_USED: "in use", BLOCK_CACHED: "cached prefix, free"}
HINT = "Move the cursor over the map (arrows or mouse) to inspect a block; Enter selects its request."


def describe_block(snapshot: CacheSnapshot, block: int, width: int | None = None) -> Content:
    """The block's state, then who points at it; with ``width``, the owners that fit and how many more."""
    state = int(snapshot.block_state[block])
    parts = [f"[b]Block {block}[/b]", _STATE_NAMES.get(state, "free")]
    if state == BLOCK_USED:
        parts.append(f"ref {int(snapshot.ref_counts[block])}")
        parts.append(f"{int(snapshot.block_fill[block])}/{snapshot.block_size} slots")
    block_hash = int(snapshot.block_hashes[block])
    parts.append(f"prefix hash {block_hash:016x}" if block_hash else "no prefix hash")
    group = snapshot.block_group(block) if snapshot.kv_cache_groups and state == BLOCK_USED else None
    if group is not None:
        parts.append(snapshot.group_label(group))
    head = Content.from_markup(" · ".join(parts))
    owners = _owners(snapshot, block, width)
    return Content("\n").join([head, owners]) if owners else head


def describe_cell(snapshot: CacheSnapshot, first: int, last: int, width: int | None = None) -> Content:
    """One block: describe it. Several (an aggregated cell): count their states, then the first in use's owners
    (two lines either way: the panel has room for two)."""
    if first == last:
        return describe_block(snapshot, first, width)
    states = Counter(int(s) for s in snapshot.block_state[first:last + 1])
    summary = Content(f"Blocks {first}–{last} (one cell): {states[BLOCK_USED]} in use, "
                      f"{states[BLOCK_CACHED]} cached, "
                      f"{last - first + 1 - states[BLOCK_USED] - states[BLOCK_CACHED]} free")
    for block in range(first, last + 1):
        if snapshot.block_state[block] == BLOCK_USED:
            label = Content(f"block {block} (ref {int(snapshot.ref_counts[block])}, "
                            f"{int(snapshot.block_fill[block])}/{snapshot.block_size} slots): ")
            rest = None if width is None else max(width - label.cell_length, 1)
            return Content("\n").join([summary, label + _owners(snapshot, block, rest)])
    return summary


def _owners(snapshot: CacheSnapshot, block: int, width: int | None) -> Content:
    """Each table entry pointing at the block, as many as fit in ``width`` cells, then how many more."""
    owners = snapshot.owners(block)
    colour = {view.request_id: view.arrival_index % NUM_OWNER_COLOURS for view in snapshot.requests}
    entries = [
        Content.from_markup(f"[${owner_variable(colour[rid])}]$rid[/]", rid=rid)
        + Content(f"{'' if sample == 0 else f'[s{sample}]'} logical {logical}")
        for rid, sample, logical in owners
    ]
    shown = len(entries)
    if width is not None:
        while shown > 1 and sum(e.cell_length + 2 for e in entries[:shown]) + len(f"+{len(entries)} more") > width:
            shown -= 1
    line = Content(", ").join(entries[:shown])
    return line + Content(f", +{len(entries) - shown} more") if shown < len(entries) else line


class BlockInspector(SnapshotPanel):
    PLACEHOLDER = HINT
    cell: tuple[int, int] | None = None

    def inspect(self, first: int, last: int) -> None:
        self.cell = (first, last)
        self._redraw()

    def _redraw(self) -> None:
        if self._snapshot is None or self.cell is None:
            return
        first, last = self.cell
        if last >= self._snapshot.num_blocks:
            self.show(Content(HINT))
            return
        self.show(describe_cell(self._snapshot, first, last, self.size.width or None))
