"""A text panel drawn line by line: new text repaints only the lines that changed.

The live view's text panels (counters, paged vs contiguous, block details, block
table, system) get new text every frame, and most of their lines are the same
as before. A Static re-parses, re-wraps and repaints all of its lines, through
Textual's full per-line pass, on any change. Here a line given as markup is
parsed only when its markup changed, is wrapped once for the current width, and
only the rows it covers are repainted. A layout pass, which repaints the whole
screen, is asked for only when the panel's height is "auto" and its row count
changed. Text taller than the panel scrolls (mouse wheel, or keys when the panel
has the focus) rather than being cut: the panel is a ScrollView whose virtual
height is its row count.
"""

from __future__ import annotations

from typing import ClassVar

from textual.content import Content
from textual.events import Resize
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.visual import RenderOptions

from kvscope.engine.outputs import CacheSnapshot

Line = str | Content   # a markup string, or ready-made Content


class LinePanel(ScrollView, can_focus=False):
    PLACEHOLDER: ClassVar[str] = ""     # what a panel shows before its first text

    def __init__(self, text: str | Content | None = None, *, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._sources: list[Line] = []           # what each line was made from, to compare the next text with
        self._lines: list[Content] = []
        self._wrapped: list[list[Strip] | None] = []   # each line's rows at the current width, when drawn
        self._rows: list[tuple[int, int]] | None = None   # row -> (line, row within the line)
        self.show(self.PLACEHOLDER if text is None else text)

    def on_mount(self) -> None:
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._rewrap())

    # --- feeding ---------------------------------------------------------------------------

    def show(self, text: str | Content) -> None:
        """Show ``text`` (markup, or Content), repainting only the rows of the lines that changed."""
        sources: list[Line] = text.split("\n") if isinstance(text, str) else text.split("\n", allow_blank=True)
        old = self._sources
        if len(sources) != len(old):
            self._sources = sources
            self._lines = [_parse(source) for source in sources]
            self._rewrap()
            return
        changed = [i for i, (new, before) in enumerate(zip(sources, old, strict=True)) if not _same(new, before)]
        if not changed:
            return
        self._sources = sources
        for i in changed:   # every changed line first: a re-wrap below returns before the loop ends
            self._lines[i] = _parse(sources[i])
        width = self._width
        if not width or self._rows is None:
            self._wrapped = [None if i in changed else rows for i, rows in enumerate(self._wrapped)]
            return
        top = round(self.scroll_offset.y)
        regions = []
        for i in changed:
            before = self._wrapped[i]
            after = self._wrapped[i] = self._wrap(i, width)
            if before is None or len(before) != len(after):
                self._rewrap()   # the lines below move: repaint them all
                return
            regions.append(Region(0, self._first_row(i) - top, self.size.width, len(after)))
        self.refresh(*regions)

    def render(self) -> Content:
        """Everything the panel shows, as one Content (for tests and for reading the panel)."""
        return Content("\n").join(self._lines)

    # --- drawing -------------------------------------------------------------------------------

    @property
    def _width(self) -> int:
        """The wrapping width: the content's, less the scrollbar's gutter."""
        return self.scrollable_content_region.width

    def _rewrap(self) -> None:
        rows_before = len(self._rows) if self._rows is not None else -1
        self._wrapped = [None] * len(self._lines)
        self._rows = None
        rows = len(self._row_map())
        self.virtual_size = Size(self._width, rows)
        auto_height = self.styles.height is None or self.styles.height.is_auto
        self.refresh(layout=auto_height and rows_before != rows)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._wrapped = [None] * len(self._lines)
        self._rows = None

    def on_resize(self, event: Resize) -> None:
        self._rewrap()

    def watch_show_vertical_scrollbar(self, shown: bool) -> None:
        # The scrollbar takes a column from the text: wrap again at the width that is left.
        self.call_later(self._rewrap)

    def _wrap(self, index: int, width: int) -> list[Strip]:
        strips = self._lines[index].render_strips(width, None, self.visual_style,
                                                  RenderOptions(self._get_style, self.styles))
        return strips or [Strip.blank(width, self.rich_style)]

    def _row_map(self) -> list[tuple[int, int]]:
        if self._rows is None:
            width = self._width
            rows = []
            for i in range(len(self._lines)):
                if width and self._wrapped[i] is None:
                    self._wrapped[i] = self._wrap(i, width)
                rows.extend((i, sub) for sub in range(len(self._wrapped[i]) if width else 1))
            self._rows = rows
        return self._rows

    def _first_row(self, index: int) -> int:
        return sum(len(self._wrapped[i]) for i in range(index))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if width == self._width:
            return len(self._row_map())
        return sum(len(self._wrap(i, width)) for i in range(len(self._lines))) if width else len(self._lines)

    def render_line(self, y: int) -> Strip:
        rows = self._row_map()
        y += round(self.scroll_offset.y)
        if y >= len(rows) or not self._width:
            return Strip.blank(self._width, self.rich_style)
        index, sub = rows[y]
        return self._wrapped[index][sub]


class SnapshotPanel(LinePanel):
    """A panel about one part of the latest snapshot (a request's table, a block, a slot): a new snapshot or a new
    part asked for redraws it the same way."""

    _snapshot: CacheSnapshot | None = None

    def show_snapshot(self, snapshot: CacheSnapshot) -> None:
        self._snapshot = snapshot
        self._redraw()

    def _redraw(self) -> None:
        raise NotImplementedError


def _parse(source: Line) -> Content:
    return Content.from_markup(source) if isinstance(source, str) else source


def _same(a: Line, b: Line) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return type(a) is type(b) and a == b
    return a.is_same(b)   # Content's == compares the text only, not its styles
