"""The selected request's block tables: logical → physical block, per sample, and the last block's fill."""

from __future__ import annotations

from textual.markup import escape

from kvscope.app.widgets.line_panel import SnapshotPanel
from kvscope.engine.outputs import CacheSnapshot, RequestView
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable

HINT = "Select a request (in the queues, or Enter on the map) to see its block table."


def _table_line(label: str, table: tuple[int, ...], snapshot: CacheSnapshot, colour: str,
                host: bool = False) -> str:
    entries = []
    # A sliding window's freed entries (-1) lead the table: said once, as a count.
    freed = next((i for i, physical in enumerate(table) if physical >= 0), len(table))
    if freed:
        entries.append(f"[dim]0–{freed - 1} left the window[/]")
    for logical, physical in enumerate(table[freed:], start=freed):
        shared = not host and snapshot.ref_counts[physical] > 1
        marker = "*" if shared else ""
        prefix = "h" if host else ""
        entries.append(f"{logical}→[{colour}]{prefix}{physical}{marker}[/]")
    return f"[dim]{label}[/] " + "  ".join(entries)


def describe_request(view: RequestView, snapshot: CacheSnapshot) -> str:
    """Markup, one line per table: the panel re-parses only the lines that changed since the last frame."""
    colour = "$" + owner_variable(view.arrival_index % NUM_OWNER_COLOURS)
    num_blocks = len({b for table in view.block_tables for b in table})
    blocks = f"{num_blocks} device block{'' if num_blocks == 1 else 's'}"
    head = [f"[b {colour}]{escape(view.request_id)}[/] · {view.queue} · {blocks}"]
    tables = [t for t in view.block_tables if t]
    if tables:
        last = tables[0][-1]
        head.append(f"last block {int(snapshot.block_fill[last])}/{snapshot.block_size} slots")
    if any(t for t in view.block_tables if any(snapshot.ref_counts[b] > 1 for b in t)):
        head.append("* shared")
    lines = [" · ".join(head)]
    for sample, tables in enumerate(view.group_block_tables or [(table,) for table in view.block_tables]):
        for group, table in enumerate(tables):
            label = f"sample {sample}" if len(view.block_tables) > 1 else "table"
            if view.group_block_tables:
                label = f"{label} · {snapshot.group_label(group)}"
            lines.append(_table_line(label, table, snapshot, colour))
    for sample, table in enumerate(view.host_block_tables):
        if table:
            lines.append(_table_line(f"host {sample}", table, snapshot, colour, host=True))
    if not view.block_tables and not any(view.host_block_tables):
        lines.append("holds no blocks yet (waiting)")
    return "\n".join(lines)


class BlockTable(SnapshotPanel, can_focus=True):
    PLACEHOLDER = HINT
    request_id: str | None = None

    def select(self, request_id: str | None) -> None:
        self.request_id = request_id
        self._redraw()

    def _redraw(self) -> None:
        if self._snapshot is None or self.request_id is None:
            self.show(escape(HINT))
            return
        view = next((v for v in self._snapshot.requests if v.request_id == self.request_id), None)
        if view is None:
            self.show(f"[b]{escape(self.request_id)}[/b] has finished: its blocks went back to the pool.")
        else:
            self.show(describe_request(view, self._snapshot))
