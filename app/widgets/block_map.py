"""The block map: one cell per physical KV block (or per run of blocks, for a pool larger than the panel),
drawn with Textual's line API.

A new snapshot brings the map's own counts up to date from the blocks the steps changed (map_aggregates.py),
then becomes one integer per cell (block_cells.py); rows whose integers did not change keep their cached Strip
and are not repainted, so a decode step that touches a handful of blocks repaints a handful of lines, and a
frame of a 340,000-block pool costs its cells, not its blocks.

Where one cell stands for hundreds of blocks, two keys make the pool explorable: ``z`` zooms into the blocks
around the cursor, one cell per block (the arrows scroll past the region's edges), and ``f`` shows only the
selected request's blocks, one cell per block in the order of its block table. Esc, or the same key again,
goes back to the whole pool. With KV-cache groups, ``w`` shows one attention kind's blocks at a time
(map_groups.py says why a key and not a colour).
"""

from __future__ import annotations

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.actions import SkipAction
from textual.binding import Binding
from textual.events import Click, Leave, MouseMove, Resize
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from kvscope.app.messages import BlockHighlighted, RequestSelected
from kvscope.app.widgets import block_cells as cells
from kvscope.app.widgets.cell_styles import RUN_KEY, CellStyles
from kvscope.app.widgets.line_cache import LineCache
from kvscope.app.widgets.map_aggregates import MapAggregates
from kvscope.app.widgets.map_groups import GroupSelector
from kvscope.app.widgets.theme_styled import ThemeStyled
from kvscope.engine.outputs import BlockArrays, CacheSnapshot
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable

SWAPPED_GLYPH = "▚"
MAX_KEPT_VERSIONS = 1024   # steps' changes kept between two frames; past that, reading the pool once is cheaper


class BlockMap(GroupSelector, CellStyles, ThemeStyled, Widget, can_focus=True):
    BINDINGS = [
        Binding("left", "move(-1, 0)", "Left", show=False),
        Binding("right", "move(1, 0)", "Right", show=False),
        Binding("up", "move(0, -1)", "Up", show=False),
        Binding("down", "move(0, 1)", "Down", show=False),
        Binding("enter", "select_owner", "Select owner"),
        Binding("escape", "clear_selection", "Clear selection", show=False),
        Binding("z", "zoom", "Zoom", tooltip="Zoom into the blocks around the cursor, one cell per block "
                "(the arrows scroll on); again, or Esc, for the whole pool"),
        Binding("f", "focus_request", "Focus", tooltip="Only the selected request's blocks (else the cursor's "
                "owner), one cell per block in table order; again, or Esc, for the whole pool"),
        Binding("w", "next_kind", "Groups", tooltip="One attention kind's blocks at a time (full attention, "
                "sliding window), the rest dimmed; after the last, the whole pool. Only with KV-cache groups"),
    ]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.snapshot: CacheSnapshot | None = None
        self.map_layout: cells.MapLayout | None = None
        # What the cells show: None, the whole pool; else these block ids in order (a zoomed region or the
        # focused request's table), and which of the two.
        self.shown_blocks: np.ndarray | None = None
        self.zoom_start: int | None = None
        self.focused_request: str | None = None
        self._aggregates: MapAggregates | None = None
        self._counted: CacheSnapshot | None = None
        self._versions: list[BlockArrays] = []   # the steps' block arrays since the last frame, oldest first
        self.selected_request: str | None = None
        self.chat_request: str | None = None
        self.marked_blocks: tuple[int, ...] = ()
        self.cursor_cell: int | None = None
        self._codes = np.zeros(0, dtype=np.int32)
        self._lines: LineCache[int] = LineCache(self._render_row)
        self._styles: dict[int, Style] = {}
        self._cell_cache: dict[int, Segment] = {}  # one-char cells: (code, run length) -> segment

    # --- feeding -------------------------------------------------------------------

    def show_snapshot(self, snapshot: CacheSnapshot) -> None:
        self.snapshot = snapshot
        self._follow_kinds(snapshot)
        self._recompute()

    def pool_totals(self, snapshot: CacheSnapshot) -> tuple[int, int, np.ndarray] | None:
        """(blocks in use, tokens in them, every block's fill) of ``snapshot``, from the counts the map keeps:
        O(cells). None when the map has not counted that snapshot (not drawn yet, or no room to draw)."""
        aggregates = self._aggregates
        if aggregates is None or self._counted is not snapshot:
            return None
        return aggregates.used_blocks(), aggregates.used_tokens, aggregates.fill

    def note_step(self, snapshot: CacheSnapshot) -> None:
        """A step the map may not draw: its block changes are kept, so the next frame applies them instead of
        reading the whole pool again. A window that stops drawing (another screen on top) stops keeping them."""
        versions = self._versions
        if len(versions) >= MAX_KEPT_VERSIONS:
            versions.clear()    # the next frame reads the whole arrays once
        versions.append(snapshot.blocks)

    def select_request(self, request_id: str | None) -> None:
        self.selected_request = request_id
        self._recompute()

    def set_chat_request(self, request_id: str | None) -> None:
        self.chat_request = request_id
        self._recompute()

    def mark_blocks(self, blocks) -> None:
        """Draw these physical blocks in the marked colour (a lesson pointing at them); () clears."""
        self.marked_blocks = tuple(blocks)
        self._recompute()

    # --- cells -----------------------------------------------------------------------

    @property
    def _host_lines(self) -> int:
        snapshot = self.snapshot
        return 1 if snapshot is not None and snapshot.num_host_blocks and self.size.height > 1 else 0

    def _recompute(self) -> None:
        snapshot = self.snapshot
        if snapshot is None or not self.size.area:
            return
        height = self.size.height - self._host_lines
        pool = cells.fit_layout(snapshot.num_blocks, self.size.width, height)
        aggregates = self._aggregates
        if aggregates is None or (aggregates.num_blocks, aggregates.blocks_per_cell) != (pool.num_blocks,
                                                                                            pool.blocks_per_cell):
            aggregates = self._aggregates = MapAggregates(pool.num_blocks, pool.blocks_per_cell)
            self._counted = None
        if snapshot is not self._counted:
            aggregates.update(snapshot, self._versions)
            self._counted = snapshot
        self._versions.clear()
        shown = self._blocks_to_show(snapshot, pool)
        self.shown_blocks = shown
        if shown is None:
            layout, data = pool, cells.pool_cells(aggregates)
        else:
            layout = cells.fit_layout(shown.size, self.size.width, height)
            data = cells.block_cells(aggregates, shown, layout.blocks_per_cell)
        codes = cells.codes(
            data, snapshot.block_size,
            selected=self._with_kind(self._cells_of(cells.request_blocks(snapshot, self.selected_request), layout),
                                     layout),
            chat=self._cells_of(cells.request_blocks(snapshot, self.chat_request), layout),
            cursor=self.cursor_cell if self.has_focus or self.mouse_hover else None,
            marked=self._cells_of(np.array(self.marked_blocks, dtype=np.int64) if self.marked_blocks else None,
                                  layout),
        )
        if layout != self.map_layout or codes.size != self._codes.size or shown is not None:
            self.map_layout, self._codes = layout, codes
            self._lines.clear()
            self._cell_cache.clear()
            self.border_subtitle = self._caption()
            self.refresh()
        else:
            self._refresh_changed_rows(codes)
        self._refresh_host_line()

    def _blocks_to_show(self, snapshot: CacheSnapshot, pool: cells.MapLayout) -> np.ndarray | None:
        """The block ids the cells show in order, or None for the whole pool."""
        if self.focused_request is not None:
            blocks = cells.request_blocks(snapshot, self.focused_request)
            return np.zeros(0, dtype=np.int64) if blocks is None else blocks
        if self.zoom_start is None:
            return None
        page = self._zoom_page()
        self.zoom_start = min(max(0, self.zoom_start), max(0, snapshot.num_blocks - page))
        return np.arange(self.zoom_start, min(self.zoom_start + page, snapshot.num_blocks), dtype=np.int64)

    def _zoom_page(self) -> int:
        """Blocks a zoomed region holds: whole rows of two-char cells (a glyph and a gap) that fill the panel."""
        return max(1, self.size.width // 2) * max(1, self.size.height - self._host_lines)

    def _cells_of(self, blocks: np.ndarray | None, layout: cells.MapLayout) -> np.ndarray | None:
        """The cells showing any of ``blocks`` (None: none)."""
        if blocks is None:
            return None
        shown = self.shown_blocks
        if shown is None:
            return np.unique(blocks[blocks < layout.num_blocks] // layout.blocks_per_cell)
        return np.unique(np.flatnonzero(np.isin(shown, blocks)) // layout.blocks_per_cell)

    def cell_blocks(self, cell: int) -> list[int]:
        """The physical blocks one cell stands for."""
        layout = self.map_layout
        if self.shown_blocks is None:
            return list(layout.blocks_of(cell))
        width = layout.blocks_per_cell
        return self.shown_blocks[cell * width:(cell + 1) * width].tolist()

    def _refresh_changed_rows(self, codes: np.ndarray) -> None:
        columns = self.map_layout.columns
        padded = self.map_layout.num_rows * columns
        old = np.resize(self._codes, padded) if self._codes.size != padded else self._codes
        new = np.resize(codes, padded) if codes.size != padded else codes
        changed = np.flatnonzero((old != new).reshape(-1, columns).any(axis=1))
        self._codes = codes
        for row in changed.tolist():
            self._lines.drop(row)
            self.refresh(Region(0, row, self.size.width, 1))

    def _refresh_host_line(self) -> None:
        if self._host_lines:
            host_row = self.size.height - 1
            self._lines.drop(host_row)
            self.refresh(Region(0, host_row, self.size.width, 1))

    # --- line API ------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        return self._lines.line(y)

    def _render_row(self, y: int) -> Strip:
        width = self.size.width
        layout = self.map_layout
        if self.snapshot is None or layout is None:
            return Strip.blank(width, self.rich_style)
        if self._host_lines and y == self.size.height - 1:
            return self._render_host_line(width)
        row = self._codes[y * layout.columns:(y + 1) * layout.columns]
        if not row.size:
            return Strip.blank(width, self.rich_style)
        starts = np.flatnonzero(np.concatenate(([True], row[1:] != row[:-1])))
        if layout.cell_width == 1:
            # Large pools repaint thousands of cells a frame: one cached segment per (code, run length).
            counts = np.diff(np.append(starts, row.size))
            keys = (row[starts].astype(np.int64) * RUN_KEY + counts).tolist()
            cache = self._cell_cache
            for key in set(keys).difference(cache):
                self._run_segment(key)
            segments = [cache[key] for key in keys]
        else:
            counts = np.diff(np.append(starts, row.size)).tolist()
            segments = []
            for code, count in zip(row[starts].tolist(), counts, strict=True):
                segments.extend(self._cell_segments(code, count))
        used = row.size * layout.cell_width
        if used < width:
            segments.append(Segment(" " * (width - used), self.rich_style))
        return Strip(segments, width)

    def _render_host_line(self, width: int) -> Strip:
        snapshot = self.snapshot
        used = snapshot.num_host_blocks - snapshot.num_free_host_blocks
        label = Style(color=self._colour("block-swapped").rich_color, bgcolor=self.rich_style.bgcolor)
        segments = [Segment(f"host pool {used}/{snapshot.num_host_blocks} ", label)]
        for view in snapshot.requests:
            count = sum(len(table) for table in view.host_block_tables)
            if count:
                colour = self._colour(owner_variable(view.arrival_index % NUM_OWNER_COLOURS))
                segments.append(Segment(f"{view.request_id}:", self.rich_style))
                segments.append(Segment(SWAPPED_GLYPH * min(count, 12) + f"{count} ",
                                        Style(color=colour.rich_color, bgcolor=self.rich_style.bgcolor)))
        return Strip(segments).crop_extend(0, width, self.rich_style)

    # --- cursor, mouse -----------------------------------------------------------------------

    def on_resize(self, event: Resize) -> None:
        self.map_layout = None
        self._recompute()

    def _move_cursor(self, cell: int | None) -> None:
        if cell == self.cursor_cell or self.map_layout is None:
            return
        self.cursor_cell = cell
        self._recompute()
        self._announce_cursor()

    def _announce_cursor(self) -> None:
        """Tell the inspector which blocks the cursor is on."""
        blocks = self.cell_blocks(self.cursor_cell) if self.cursor_cell is not None else []
        if blocks:
            self.post_message(BlockHighlighted(blocks[0], blocks[-1]))

    def move_cursor_to_block(self, block_id: int) -> None:
        if self.map_layout is None:
            return
        if self.shown_blocks is None:
            self._move_cursor(block_id // self.map_layout.blocks_per_cell)
            return
        found = np.flatnonzero(self.shown_blocks == block_id)
        if found.size:
            self._move_cursor(int(found[0]) // self.map_layout.blocks_per_cell)

    def action_move(self, dx: int, dy: int) -> None:
        layout = self.map_layout
        if layout is None:
            return
        cell = 0 if self.cursor_cell is None else self.cursor_cell + dx + dy * layout.columns
        if self.zoom_start is not None and not 0 <= cell < layout.num_cells:
            # Past the region's edge: the region moves by a row under the cursor, through the whole pool.
            step = layout.columns if dy else 1
            start = self.zoom_start + (step if cell >= layout.num_cells else -step)
            if 0 <= start <= self.snapshot.num_blocks - layout.num_blocks:
                self.zoom_start = start
                self._recompute()
                self._announce_cursor()
                return
        self._move_cursor(min(max(cell, 0), max(0, layout.num_cells - 1)))

    def action_zoom(self) -> None:
        """Into the blocks around the cursor, one cell per block; from a zoom or a focus, back to the pool."""
        if self.snapshot is None or self.map_layout is None:
            return
        block = self._cursor_block()
        if self.zoom_start is not None or self.focused_request is not None:
            self._show_pool(block)
            return
        columns = max(1, self.size.width // 2)
        page = self._zoom_page()
        # The cursor's block in the middle row of the region, rows aligned to the pool's start.
        self.zoom_start = max(0, (block // columns - page // columns // 2) * columns)
        self._show_around(block)

    def action_focus_request(self) -> None:
        """Only the selected request's blocks (else the one under the cursor), in table order; again: the pool."""
        if self.snapshot is None or self.map_layout is None:
            return
        if self.focused_request is not None:
            self._show_pool(self._cursor_block())
            return
        request_id = self.selected_request or (
            self.owner_of_cell(self.cursor_cell) if self.cursor_cell is not None else None)
        if request_id is None:
            self.app.bell()
            return
        self.zoom_start, self.focused_request = None, request_id
        self.cursor_cell = None
        self._recompute()
        self._move_cursor(0)

    def _cursor_block(self) -> int:
        blocks = self.cell_blocks(self.cursor_cell) if self.cursor_cell is not None else []
        return blocks[0] if blocks else 0

    def _show_pool(self, block: int) -> None:
        self.zoom_start = self.focused_request = None
        self._show_around(block)

    def _show_around(self, block: int) -> None:
        """Draw the new view with the cursor on ``block``."""
        self.cursor_cell = None
        self._recompute()
        self.move_cursor_to_block(block)

    def _cell_under(self, event: MouseMove | Click) -> int | None:
        offset = event.get_content_offset(self)
        if offset is None or self.map_layout is None:
            return None
        return self.map_layout.cell_at(offset.x, offset.y)

    def on_mouse_move(self, event: MouseMove) -> None:
        cell = self._cell_under(event)
        if cell is not None:
            self._move_cursor(cell)

    # Textual sets has_focus and mouse_hover in the base class's handlers, which run after these:
    # the cursor is redrawn once the event has been handled.

    def on_leave(self, event: Leave) -> None:
        self.call_next(self._recompute)

    def on_focus(self) -> None:
        if self.cursor_cell is None:
            self.action_move(0, 0)
        self.call_next(self._recompute)

    def on_blur(self) -> None:
        self.call_next(self._recompute)

    def on_click(self, event: Click) -> None:
        cell = self._cell_under(event)
        if cell is not None:
            self._move_cursor(cell)
        self.action_select_owner()

    def owner_of_cell(self, cell: int) -> str | None:
        snapshot = self.snapshot
        for block in self.cell_blocks(cell):
            owners = snapshot.owners(block)
            if owners:
                return owners[0][0]
        return None

    def action_select_owner(self) -> None:
        if self.cursor_cell is not None and self.snapshot is not None:
            self.post_message(RequestSelected(self.owner_of_cell(self.cursor_cell)))

    def action_clear_selection(self) -> None:
        if self.zoom_start is not None or self.focused_request is not None:
            self._show_pool(self._cursor_block())
            return
        if self.selected_request is None:
            raise SkipAction()  # nothing to clear: let Escape mean what the screen says
        self.post_message(RequestSelected(None))
