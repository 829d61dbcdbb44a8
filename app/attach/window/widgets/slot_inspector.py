"""The slot under the map's cursor in an attached pool: what vLLM said about the block kvscope put there.

Slots are kvscope's, not vLLM's: events name blocks by content hash, so where a
block really sits in the server's memory is unknown, and the panel says so.
"""

from __future__ import annotations

from textual.content import Content

from kvscope.app.widgets.line_panel import SnapshotPanel
from kvscope.engine.outputs import BLOCK_USED, CacheSnapshot
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable

HINT = ("Move the cursor over a map (arrows or mouse). Slots are kvscope's: vLLM's events name blocks by "
        "content hash, never by where they sit in its memory.")


def describe_slot(snapshot: CacheSnapshot, slot: int) -> Content:
    state = int(snapshot.block_state[slot])
    block_hash = int(snapshot.block_hashes[slot])
    if state == BLOCK_USED and block_hash:
        owners = snapshot.owners(slot)
        tree = next((v for v in snapshot.requests if owners and v.request_id == owners[0][0]), None)
        where = ""
        if tree is not None:
            colour = owner_variable(tree.arrival_index % NUM_OWNER_COLOURS)
            where = f" · [${colour}]{tree.request_id}[/] block {owners[0][2] + 1} of {len(tree.block_tables[0])}"
        return Content.from_markup(
            f"[b]Slot {slot}[/b] · announced full block · hash {block_hash:016x}{where}\n"
            "[dim]in use by a request or cached and free: vLLM's events do not say which[/]")
    if state == BLOCK_USED:
        return Content.from_markup(
            f"[b]Slot {slot}[/b] · in use, not announced\n[dim]counted from kv_cache_usage_perc: a block a "
            "request holds that is not full yet (vLLM names no such block)[/]")
    return Content.from_markup(f"[b]Slot {slot}[/b] · free, or holding a block kvscope was never told of")


class SlotInspector(SnapshotPanel):
    PLACEHOLDER = HINT
    slot: int | None = None

    def inspect(self, slot: int) -> None:
        self.slot = slot
        self._redraw()

    def _redraw(self) -> None:
        if self._snapshot is None or self.slot is None or self.slot >= self._snapshot.num_blocks:
            self.show(Content(HINT))
            return
        self.show(describe_slot(self._snapshot, self.slot))
