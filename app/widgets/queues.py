"""Running, waiting and swapped requests: one keyed row per request, updated in place, line API.

A DataTable re-renders every visible cell whenever any cell changes, which with
hundreds of decoding requests costs more than the engine step it shows. Here a
row is one cached Strip, rebuilt only when that request's numbers change, and
only the lines of changed rows are repainted.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.color import Color
from textual.events import Click, Resize
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from kvscope.app.messages import RequestSelected
from kvscope.engine.outputs import CacheSnapshot, RequestView
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable

QUEUE_ORDER = {"running": 0, "swapped": 1, "waiting": 2}
# queue -> (label, theme variable of its colour, dim)
QUEUE_LABELS = {"running": ("▶ run", "success", False), "swapped": ("⇄ swap", "warning", False),
                "waiting": ("… wait", "foreground", True)}
# (header, width, right-aligned); the prompt column takes whatever width is left
COLUMNS = (("request", 11, False), ("queue", 7, False), ("prompt", 0, False), ("prefill", 9, True),
           ("output", 10, True), ("blocks", 7, True), ("cached", 7, True), ("preempt", 8, True))
PROMPT_COLUMN = 2
MIN_PROMPT_WIDTH = 8
# The columns a narrow table leaves out, first to last.
DROP_ORDER = tuple(next(i for i, (header, _, _) in enumerate(COLUMNS) if header == name)
                   for name in ("prompt", "cached", "preempt", "prefill"))


def row_cells(view: RequestView) -> tuple[str, ...]:
    """The row of one request; compared with the previous row so unchanged rows keep their Strip."""
    device_blocks = len({b for table in view.block_tables for b in table})
    host_blocks = sum(len(t) for t in view.host_block_tables)
    samples = f"×{view.num_samples} " if view.num_samples > 1 else ""
    return (
        view.request_id,
        view.queue,
        view.prompt_preview.replace("\n", " "),
        f"{min(view.num_computed_tokens, view.num_prompt_tokens)}/{view.num_prompt_tokens}",
        f"{samples}{view.num_output_tokens}/{view.max_tokens}",
        f"{device_blocks}" + (f"+{host_blocks}h" if host_blocks else ""),
        str(view.num_cached_tokens),
        str(view.num_preemptions),
    )


def _fit(text: str, width: int, right: bool) -> str:
    if len(text) > width - 1:
        text = text[: max(width - 2, 0)] + "…"
    return text.rjust(width - 1) + " " if right else text.ljust(width)


class QueuesTable(ScrollView, can_focus=True):
    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "cursor(-10)", "Page up", show=False),
        Binding("pagedown", "cursor(10)", "Page down", show=False),
        Binding("enter", "select", "Select request"),
    ]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.rows: dict[str, tuple[str, ...]] = {}
        self.order: list[str] = []
        self.cursor_request: str | None = None
        self._arrival: dict[str, int] = {}
        self._position: dict[str, int] = {}
        self._strips: dict[str, Strip] = {}
        self._styles: dict[tuple[str, bool, bool], Style] = {}
        self._plain: Style | None = None
        self._widths: dict[int, int] = {}   # the columns shown (all but the first two plain) -> width
        self._widths_for = -1   # the width the columns were fitted to

    def on_mount(self) -> None:
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._restyle())
        self._update_title()

    # --- data ------------------------------------------------------------------------

    def show_snapshot(self, snapshot: CacheSnapshot) -> None:
        live: dict[str, tuple[str, ...]] = {}
        changed: list[str] = []
        reorder = False
        for view in snapshot.requests:
            cells = row_cells(view)
            live[view.request_id] = cells
            old = self.rows.get(view.request_id)
            if old != cells:
                changed.append(view.request_id)
                self._strips.pop(view.request_id, None)
                reorder |= old is None or old[1] != cells[1]
            self._arrival[view.request_id] = view.arrival_index
        reorder |= len(live) != len(self.rows)
        for gone in self.rows.keys() - live.keys():
            self._strips.pop(gone, None)
            self._arrival.pop(gone, None)
        self.rows = live
        if reorder:
            self._reorder()
        else:
            self._refresh_rows([self._position[request_id] for request_id in changed])
        self._update_title()

    def _reorder(self) -> None:
        rank = QUEUE_ORDER.get
        self.order = sorted(self.rows, key=lambda rid: (rank(self.rows[rid][1], 3), self._arrival[rid]))
        self._position = {rid: i for i, rid in enumerate(self.order)}
        self.virtual_size = Size(self.size.width, len(self.order) + 1)
        self.refresh()

    def _refresh_rows(self, positions: list[int]) -> None:
        """Repaint the lines of the rows at ``positions`` that are in view."""
        top = round(self.scroll_offset.y)
        width, height = self.size
        lines = [position - top + 1 for position in positions]
        regions = [Region(0, line, width, 1) for line in lines if 1 <= line < height]
        if regions:
            self.refresh(*regions)

    def _update_title(self) -> None:
        counts = {name: 0 for name in QUEUE_ORDER}
        for cells in self.rows.values():
            counts[cells[1]] = counts.get(cells[1], 0) + 1
        title = "Queues · " + " · ".join(f"{name} {n}" for name, n in counts.items())
        if title != self.border_title:
            self.border_title = title

    # --- drawing ------------------------------------------------------------------------

    def _restyle(self) -> None:
        self._forget_styles()
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._forget_styles()

    def _forget_styles(self) -> None:
        self._styles.clear()
        self._strips.clear()
        self._plain = None

    @property
    def _plain_style(self) -> Style:
        """The widget's own style, looked up once per theme: every row of every frame uses it."""
        if self._plain is None:
            self._plain = self.rich_style
        return self._plain

    def _style(self, variable: str, bold: bool = False, dim: bool = False) -> Style:
        key = (variable, bold, dim)
        style = self._styles.get(key)
        if style is None:
            colour = Color.parse(self.app.theme_variables.get(variable, "magenta"))
            style = self._styles[key] = Style(color=colour.rich_color, bgcolor=self._plain_style.bgcolor,
                                              bold=bold or None, dim=dim or None)
        return style

    def on_resize(self, event: Resize) -> None:
        self._strips.clear()
        self.virtual_size = Size(event.size.width, len(self.order) + 1)

    def _fit_columns(self, width: int) -> None:
        """Every column when they fit; narrower, the prompt first, then the least needed ones go."""
        shown = list(range(len(COLUMNS)))
        fixed = sum(w for _, w, _ in COLUMNS)
        for column in DROP_ORDER:
            needed = fixed + (MIN_PROMPT_WIDTH if PROMPT_COLUMN in shown else 0)
            if needed <= width:
                break
            shown.remove(column)
            fixed -= COLUMNS[column][1]
        self._widths_for = width
        self._widths = {i: max(width - fixed, MIN_PROMPT_WIDTH) if i == PROMPT_COLUMN else COLUMNS[i][1]
                        for i in shown}

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if self._widths_for != width:
            self._fit_columns(width)
        if y == 0:
            return self._header(width)
        position = round(self.scroll_offset.y) + y - 1
        if position >= len(self.order):
            return Strip.blank(width, self._plain_style)
        request_id = self.order[position]
        strip = self._strips.get(request_id)
        if strip is None:
            strip = self._strips[request_id] = self._row_strip(request_id, width)
        if request_id == self.cursor_request and self.has_focus:
            strip = strip.apply_style(Style(bgcolor=self._style("primary").color, color="black"))
        return strip

    def _header(self, width: int) -> Strip:
        style = self._style("primary", bold=True)
        text = "".join(_fit(COLUMNS[i][0], w, COLUMNS[i][2]) for i, w in self._widths.items())
        return Strip([Segment(text, style)]).crop_extend(0, self.size.width, self._plain_style)

    def _row_strip(self, request_id: str, width: int) -> Strip:
        cells = self.rows[request_id]
        widths = self._widths
        plain = self._plain_style
        owner = owner_variable(self._arrival[request_id] % NUM_OWNER_COLOURS)
        label, variable, dim = QUEUE_LABELS.get(cells[1], (cells[1], "foreground", False))
        # The columns after the queue share one style: one segment for all of them.
        rest = "".join(_fit(cells[i], w, COLUMNS[i][2]) for i, w in widths.items() if i >= 2)
        segments = [Segment(_fit(cells[0], widths[0], False), self._style(owner, bold=True)),
                    Segment(_fit(label, widths[1], False), self._style(variable, dim=dim)),
                    Segment(rest, plain)]
        return Strip(segments).crop_extend(0, width, plain)

    # --- cursor and selection ---------------------------------------------------------------

    def action_cursor(self, delta: int) -> None:
        if not self.order:
            return
        current = self._position.get(self.cursor_request, -1) if self.cursor_request else -1
        position = min(max(current + delta, 0), len(self.order) - 1)
        self._move_cursor(position)

    def _move_cursor(self, position: int) -> None:
        previous = self._position.get(self.cursor_request) if self.cursor_request else None
        self.cursor_request = self.order[position]
        self._refresh_rows([row for row in (previous, position) if row is not None])
        # Virtual line p + 1 holds row p, but line 0 of the view is the header: keep p and p + 1 in view.
        self.scroll_to_region(Region(0, position, 1, 2), animate=False, immediate=True)

    def action_select(self) -> None:
        if self.cursor_request is not None:
            self.post_message(RequestSelected(self.cursor_request))

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y == 0:
            return
        position = round(self.scroll_offset.y) + offset.y - 1
        if 0 <= position < len(self.order):
            self._move_cursor(position)
            self.action_select()

    def on_focus(self) -> None:
        if self.cursor_request is None and self.order:
            self._move_cursor(0)
        elif self.cursor_request in self._position:
            self._refresh_rows([self._position[self.cursor_request]])

    def on_blur(self) -> None:
        if self.cursor_request in self._position:
            self._refresh_rows([self._position[self.cursor_request]])
