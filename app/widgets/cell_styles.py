"""How the block map's cells look: the Rich style of each style code (its owner's colour, sharing, highlights)
and the segments of runs of equal cells, built once per code and kept until the theme or the layout changes.

A mixin of BlockMap, kept apart so that the widget's file stays about what the cells show.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.color import Color

from kvscope.app.widgets import block_cells as cells
from kvscope.themes.palette import owner_variable

DIMMED = 0.7  # how far the cells of requests other than the selected one fade into the background
RUN_KEY = 1 << 16  # cache key of a run of one-char cells: code * RUN_KEY + run length


class CellStyles:
    """Needs ``self.app``, ``self.rich_style``, ``self.map_layout``, ``_styles``, ``_cell_cache`` and ``_lines``."""

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

