"""The block map: one cell per physical KV block, drawn with Textual's line API.

A new snapshot becomes one integer per cell (block_cells.py); rows whose
integers did not change keep their cached Strip and are not repainted, so a
decode step that touches a handful of blocks repaints a handful of lines.
"""

from __future__ import annotations

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.actions import SkipAction
from textual.binding import Binding
from textual.color import Color
from textual.events import Click, Leave, MouseMove, Resize
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from kvscope.app.messages import BlockHighlighted, RequestSelected
from kvscope.app.widgets import block_cells as cells
from kvscope.app.widgets.line_cache import LineCache
from kvscope.app.widgets.theme_styled import ThemeStyled
from kvscope.engine.outputs import CacheSnapshot
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable

SWAPPED_GLYPH = "▚"
RUN_KEY = 1 << 16  # cache key of a run of one-char cells: code * RUN_KEY + run length
DIMMED = 0.7  # how far the cells of requests other than the selected one fade into the background


class BlockMap(ThemeStyled, Widget, can_focus=True):
    BINDINGS = [
        Binding("left", "move(-1, 0)", "Left", show=False),
        Binding("right", "move(1, 0)", "Right", show=False),
        Binding("up", "move(0, -1)", "Up", show=False),
        Binding("down", "move(0, 1)", "Down", show=False),
        Binding("enter", "select_owner", "Select owner"),
        Binding("escape", "clear_selection", "Clear selection", show=False),
    ]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.snapshot: CacheSnapshot | None = None
        self.map_layout: cells.MapLayout | None = None
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
        self._recompute()

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
        layout = cells.fit_layout(snapshot.num_blocks, self.size.width, self.size.height - self._host_lines)
        codes = cells.cell_codes(
            snapshot, layout,
            selected=cells.request_mask(snapshot, self.selected_request),
            chat=cells.request_mask(snapshot, self.chat_request),
            cursor=self.cursor_cell if self.has_focus or self.mouse_hover else None,
            marked=cells.block_mask(snapshot.num_blocks, self.marked_blocks),
        )
        if layout != self.map_layout or codes.size != self._codes.size:
            self.map_layout, self._codes = layout, codes
            self._lines.clear()
            self._cell_cache.clear()
            self.border_subtitle = self._caption()
            self.refresh()
        else:
            self._refresh_changed_rows(codes)
        self._refresh_host_line()

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

    def _caption(self) -> str:
        layout = self.map_layout
        per_cell = "1 cell = 1 block" if layout.blocks_per_cell == 1 else \
            f"1 cell = {layout.blocks_per_cell} blocks (pool larger than the panel)"
        return f"{layout.num_blocks:,} blocks · {per_cell}"

    # --- styles ------------------------------------------------------------------------

    def _forget_styles(self) -> None:
        self._styles.clear()
        self._cell_cache.clear()
        self._lines.clear()

    def _colour(self, variable: str) -> Color:
        return Color.parse(self.app.theme_variables.get(variable, "magenta"))

    def _style(self, style_code: int) -> Style:
        style = self._styles.get(style_code)
        if style is None:
            style = self._styles[style_code] = self._build_style(style_code)
        return style

    def _build_style(self, style_code: int) -> Style:
        overlay, base = divmod(style_code, cells.NUM_BASE_STYLES)
        widget_background = Color.from_rich_color(self.rich_style.bgcolor)
        if overlay == cells.OVERLAY_CURSOR:
            # One look whatever lies under it, so the cursor is found at a glance (a shared block's
            # digit on its owner's colour would otherwise look just like its neighbours).
            return Style(color=widget_background.rich_color, bgcolor=self._colour("block-cursor").rich_color,
                         bold=True)
        if overlay == cells.OVERLAY_MARKED:
            # A shared block's ref-count digit stays on a background (here the mark's); any other glyph
            # (fill, free dot, cached shade) is drawn in the mark's colour, so its shape still reads.
            marked = self._colour("block-marked").rich_color
            if base >= cells.STYLE_SHARED:
                return Style(color=widget_background.rich_color, bgcolor=marked, bold=True)
            return Style(color=marked, bgcolor=widget_background.rich_color, bold=True)
        background, bold = widget_background, False
        if base == cells.STYLE_FREE:
            colour = self._colour("block-free")
        elif base == cells.STYLE_CACHED:
            colour = self._colour("block-cached")
        elif base < cells.STYLE_SHARED:
            colour = self._colour(owner_variable(base - cells.STYLE_OWNER))
        else:
            colour, background, bold = self._colour("block-shared-text"), self._colour(
                owner_variable(base - cells.STYLE_SHARED)), True
        if overlay == cells.OVERLAY_CHAT:
            if background != widget_background:   # a shared block: its owner's colour moves to the digit
                colour = background
            background = self._colour("block-chat")
        elif overlay == cells.OVERLAY_DIMMED:
            colour = colour.blend(widget_background, DIMMED)
            background = background.blend(widget_background, DIMMED)
        return Style(color=colour.rich_color, bgcolor=background.rich_color, bold=bold)

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

    def _run_segment(self, key: int) -> Segment:
        code, count = divmod(key, RUN_KEY)
        segment = self._cell_cache[key] = self._cell_segments(code, count)[0]
        return segment

    def _cell_segments(self, code: int, count: int) -> list[Segment]:
        """``count`` equal cells: the glyph across each body, then a one-char gap in the widget's style."""
        style_code, glyph_index = divmod(code, cells.GLYPH_SLOTS)
        style = self._style(style_code)
        glyph = cells.GLYPHS[glyph_index]
        body_width = self.map_layout.cell_width - 1
        if body_width == 0:
            return [Segment(glyph * count, style)]
        # A ref-count digit or the free dot is written once; fill glyphs span the body.
        single = glyph in cells.SHARED_GLYPHS or glyph == cells.FREE_GLYPH
        body = glyph.center(body_width) if single else glyph * body_width
        if style.bgcolor == self.rich_style.bgcolor:
            return [Segment((body + " ") * count, style)]
        gap = Segment(" ", self.rich_style)
        return [segment for _ in range(count) for segment in (Segment(body, style), gap)]

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
        if cell is not None:
            blocks = self.map_layout.blocks_of(cell)
            self.post_message(BlockHighlighted(blocks.start, blocks.stop - 1))

    def move_cursor_to_block(self, block_id: int) -> None:
        if self.map_layout is not None:
            self._move_cursor(block_id // self.map_layout.blocks_per_cell)

    def action_move(self, dx: int, dy: int) -> None:
        if self.map_layout is None:
            return
        cell = 0 if self.cursor_cell is None else self.cursor_cell + dx + dy * self.map_layout.columns
        self._move_cursor(min(max(cell, 0), self.map_layout.num_cells - 1))

    def on_mouse_move(self, event: MouseMove) -> None:
        offset = event.get_content_offset(self)
        if offset is not None and self.map_layout is not None:
            cell = self.map_layout.cell_at(offset.x, offset.y)
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
        offset = event.get_content_offset(self)
        if offset is not None and self.map_layout is not None:
            cell = self.map_layout.cell_at(offset.x, offset.y)
            if cell is not None:
                self._move_cursor(cell)
        self.action_select_owner()

    def owner_of_cell(self, cell: int) -> str | None:
        snapshot = self.snapshot
        for block in self.map_layout.blocks_of(cell):
            owners = snapshot.owners(block)
            if owners:
                return owners[0][0]
        return None

    def action_select_owner(self) -> None:
        if self.cursor_cell is not None and self.snapshot is not None:
            self.post_message(RequestSelected(self.owner_of_cell(self.cursor_cell)))

    def action_clear_selection(self) -> None:
        if self.selected_request is None:
            raise SkipAction()  # nothing to clear: let Escape mean what the screen says
        self.post_message(RequestSelected(None))
