"""Running, waiting, swapped and recently finished requests: one keyed row each, line API.

A DataTable re-renders every visible cell whenever any cell changes, which with
hundreds of decoding requests costs more than the engine step it shows. Here a
row is one cached Strip, rebuilt only when that request's numbers change, and
only the lines of changed rows are repainted.

Nothing is cut: the id and number columns are as wide as their widest value, and
when the panel is too narrow for all of them the least needed columns go (the
prompt preview is the only text shortened). A request that leaves the snapshot
stays for FINISHED_KEEP_STEPS steps as a "recently finished" row, with its
finish reason when the step's events gave it, and its final output when the
step's outputs gave it (live; a replay has the last logged step's numbers). The
cursor moves over live rows only: Enter never selects a request that is gone.
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
from kvscope.app.widgets.line_cache import LineCache
from kvscope.app.widgets.queue_rows import (
    COLUMNS,
    DROP_ORDER,
    FINISHED_KEEP_STEPS,
    FINISHED_LABELS,
    FINISHED_MAX_ROWS,
    MIN_PROMPT_WIDTH,
    PROMPT_COLUMN,
    QUEUE_LABELS,
    QUEUE_ORDER,
    RequestFinal,
    _fit,
    column_widths,
    finished_reasons,
    row_cells,
)
from kvscope.app.widgets.theme_styled import ThemeStyled
from kvscope.engine.outputs import CacheSnapshot, EngineEvent, RequestView
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable


class QueuesTable(ThemeStyled, ScrollView, can_focus=True):
    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "cursor(-10)", "Page up", show=False),
        Binding("pagedown", "cursor(10)", "Page down", show=False),
        Binding("enter", "select", "Select request"),
    ]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.rows: dict[str, tuple[str, ...]] = {}        # live requests
        self.finished: dict[str, tuple[tuple[str, ...], int]] = {}   # gone: (row, step it went at)
        self.order: list[str] = []      # live rows in queue order, then finished rows, newest first
        self.cursor_request: str | None = None
        self._step = 0
        self._reasons: dict[str, str] = {}
        self._finals: dict[str, RequestFinal] = {}      # final outputs of steps the screen may not draw
        self._logged: dict[str, RequestFinal] = {}      # a replay's: every request's end, from the run log
        self._views: dict[str, RequestView] = {}        # live requests as last drawn
        self._arrival: dict[str, int] = {}
        self._position: dict[str, int] = {}
        self._lines: LineCache[str] = LineCache(self._row_strip)
        self._styles: dict[tuple[str, bool, bool], Style] = {}
        self._plain: Style | None = None
        self._column_widths = column_widths([])
        self._widths: dict[int, int] = {}   # the columns shown -> width
        self._widths_for = -1   # the panel width the columns were fitted to

    def on_mount(self) -> None:
        self._update_title()

    # --- data ------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every row (a new engine): its requests are not this engine's."""
        self.rows, self.finished, self._reasons, self._arrival = {}, {}, {}, {}
        self._finals, self._views = {}, {}
        self._step = 0
        self.cursor_request = None
        self._lines.clear()
        self._reorder()
        self._update_title()

    def note_step(self, events: tuple[EngineEvent, ...], outputs=()) -> None:
        """Keep the finish reasons a step's events give and its final outputs, for steps the screen never draws."""
        if events:
            self._reasons.update(finished_reasons(events))
        for output in outputs:
            if output.finished:
                self._finals[output.request_id] = RequestFinal(len(output.token_ids), output.num_preemptions,
                                                               output.num_cached_tokens, output.finish_reason)

    def note_logged_finals(self, finals: dict[str, tuple[int, int, int, str]]) -> None:
        """A replay's requests as the run log ended them: (output tokens, preemptions, cached tokens, reason) by
        id. A row that finishes between two drawn steps then shows its last numbers and its reason, not "done"
        and the numbers of the last step drawn."""
        self._logged = {rid: RequestFinal(*final) for rid, final in finals.items()}

    def show_snapshot(self, snapshot: CacheSnapshot, events: tuple[EngineEvent, ...] = ()) -> None:
        self.note_step(events)
        if snapshot.step < self._step and self.finished:
            # An earlier step (a replay going back, another run): what finished after it is not history yet.
            self.finished.clear()
            self._lines.clear()
        live: dict[str, tuple[str, ...]] = {}
        changed: list[str] = []
        reorder = False
        for view in snapshot.requests:
            cells = row_cells(view)
            live[view.request_id] = cells
            old = self.rows.get(view.request_id)
            if old != cells:
                changed.append(view.request_id)
                self._lines.drop(view.request_id)
                reorder |= old is None or old[1] != cells[1]
            self._arrival[view.request_id] = view.arrival_index
            self.finished.pop(view.request_id, None)    # an id used again
        gone = self.rows.keys() - live.keys()
        if snapshot.step >= self._step:
            for request_id in sorted(gone, key=self._arrival.get):
                self._finish(request_id, snapshot.step)
        reorder |= bool(gone) or snapshot.step < self._step or self._expire(snapshot.step)
        self._step = snapshot.step
        self.rows = live
        self._views = {view.request_id: view for view in snapshot.requests}
        # Reasons and outputs of requests that came and went between two drawn steps are of no use.
        self._reasons = {rid: reason for rid, reason in self._reasons.items() if rid in live}
        self._finals = {rid: output for rid, output in self._finals.items() if rid in live}
        widths = column_widths([*live.values(), *(row for row, _ in self.finished.values())])
        if widths != self._column_widths:
            self._column_widths, self._widths_for = widths, -1
            self._lines.clear()
            reorder = True
        if reorder:
            self._reorder()
        else:
            self._refresh_rows([self._position[request_id] for request_id in changed])
        self._keep_cursor_on_a_live_row()
        self._update_title()

    def _finish(self, request_id: str, step: int) -> None:
        final = self._finals.pop(request_id, None) or self._logged.get(request_id)
        reason = self._reasons.pop(request_id, None) or (final.finish_reason if final else None)
        label = FINISHED_LABELS.get(reason, "✓ done") if reason else "✓ done"
        row = self.rows[request_id]
        view = self._views.get(request_id)
        if final is not None and view is not None:     # the request's last numbers, not the last drawn ones
            row = row_cells(view._replace(num_output_tokens=final.num_output_tokens,
                                          num_preemptions=final.num_preemptions,
                                          num_cached_tokens=final.num_cached_tokens))
        self.finished[request_id] = ((row[0], label, *row[2:]), step)
        self._lines.drop(request_id)

    def _expire(self, step: int) -> bool:
        """Drop finished rows older than FINISHED_KEEP_STEPS, and beyond FINISHED_MAX_ROWS."""
        # Newest first, and among those of one step the earliest arrival: never the order of a set.
        keep = sorted(self.finished.items(), key=lambda item: (-item[1][1], self._arrival.get(item[0], 0)))
        keep = [(rid, entry) for rid, entry in keep[:FINISHED_MAX_ROWS] if step - entry[1] < FINISHED_KEEP_STEPS]
        if len(keep) == len(self.finished):
            return False
        for request_id in self.finished.keys() - dict(keep).keys():
            self._lines.drop(request_id)
            self._arrival.pop(request_id, None)
        self.finished = dict(keep)
        return True

    def _reorder(self) -> None:
        rank = QUEUE_ORDER.get
        live = sorted(self.rows, key=lambda rid: (rank(self.rows[rid][1], 3), self._arrival[rid]))
        done = sorted(self.finished, key=lambda rid: (-self.finished[rid][1], self._arrival.get(rid, 0)))
        self.order = live + done
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
        if self.finished:
            title += f" · finished {len(self.finished)}"
        if title != self.border_title:
            self.border_title = title

    # --- drawing ------------------------------------------------------------------------

    def _forget_styles(self) -> None:
        self._styles.clear()
        self._lines.clear()
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
        self._lines.clear()
        self.virtual_size = Size(event.size.width, len(self.order) + 1)

    def _fit_columns(self, width: int) -> None:
        """Every column when they fit; narrower, the prompt first, then the least needed ones go."""
        widths = self._column_widths
        shown = list(range(len(COLUMNS)))
        fixed = sum(widths)
        for column in DROP_ORDER:
            needed = fixed + (MIN_PROMPT_WIDTH if PROMPT_COLUMN in shown else 0)
            if needed <= width:
                break
            shown.remove(column)
            fixed -= widths[column]
        self._widths_for = width
        self._widths = {i: max(width - fixed, MIN_PROMPT_WIDTH) if i == PROMPT_COLUMN else widths[i]
                        for i in shown}

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if self._widths_for != width:
            self._fit_columns(width)
            self._lines.clear()
        if y == 0:
            return self._header(width)
        position = round(self.scroll_offset.y) + y - 1
        if position >= len(self.order):
            return Strip.blank(width, self._plain_style)
        request_id = self.order[position]
        strip = self._lines.line(request_id, width)
        if request_id == self.cursor_request and self.has_focus:
            strip = strip.apply_style(Style(bgcolor=self._style("primary").color, color="black"))
        return strip

    def _header(self, width: int) -> Strip:
        style = self._style("primary", bold=True)
        text = "".join(_fit(COLUMNS[i][0], w, COLUMNS[i][2]) for i, w in self._widths.items())
        return Strip([Segment(text, style)]).crop_extend(0, self.size.width, self._plain_style)

    def _row_strip(self, request_id: str, width: int) -> Strip:
        done = request_id not in self.rows
        cells = self.finished[request_id][0] if done else self.rows[request_id]
        widths = self._widths
        plain = self._style("foreground", dim=True) if done else self._plain_style
        owner = owner_variable(self._arrival.get(request_id, 0) % NUM_OWNER_COLOURS)
        label, variable, dim = (cells[1], "foreground", True) if done else \
            QUEUE_LABELS.get(cells[1], (cells[1], "foreground", False))
        # The columns after the queue share one style: one segment for all of them.
        rest = "".join(_fit(cells[i], w, COLUMNS[i][2]) for i, w in widths.items() if i >= 2)
        segments = [Segment(_fit(cells[0], widths[0], False), self._style(owner, bold=True, dim=done)),
                    Segment(_fit(label, widths[1], False), self._style(variable, dim=dim)),
                    Segment(rest, plain)]
        return Strip(segments).crop_extend(0, width, self._plain_style)

    # --- cursor and selection ---------------------------------------------------------------

    @property
    def num_live(self) -> int:
        return len(self.rows)

    def _keep_cursor_on_a_live_row(self) -> None:
        """When the cursor's request has gone, the cursor moves to the live row now in its place; when it
        is not even drawn (the table has no focus), it is dropped, and the next focus starts at the top."""
        if self.cursor_request is None or self.cursor_request in self.rows:
            return
        if not self.has_focus:
            self.cursor_request = None
            return
        position = self._position.get(self.cursor_request, 0)
        self.cursor_request = self.order[min(position, self.num_live - 1)] if self.num_live else None

    def action_cursor(self, delta: int) -> None:
        if not self.num_live:
            return
        current = self._position.get(self.cursor_request, -1) if self.cursor_request in self.rows else -1
        self._move_cursor(min(max(current + delta, 0), self.num_live - 1))

    def _move_cursor(self, position: int) -> None:
        previous = self._position.get(self.cursor_request) if self.cursor_request else None
        self.cursor_request = self.order[position]
        self._refresh_rows([row for row in (previous, position) if row is not None])
        # Virtual line p + 1 holds row p, but line 0 of the view is the header: keep p and p + 1 in view.
        self.scroll_to_region(Region(0, position, 1, 2), animate=False, immediate=True)

    def action_select(self) -> None:
        """Select the request under the cursor; with no live row under it, the first row's."""
        if self.cursor_request not in self.rows:
            if not self.num_live:
                return
            self._move_cursor(0)
        self.post_message(RequestSelected(self.cursor_request))

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y == 0:
            return
        position = round(self.scroll_offset.y) + offset.y - 1
        if 0 <= position < self.num_live:
            self._move_cursor(position)
            self.action_select()

    def on_focus(self) -> None:
        if self.cursor_request not in self.rows and self.num_live:
            self._move_cursor(0)
        elif self.cursor_request in self._position:
            self._refresh_rows([self._position[self.cursor_request]])

    def on_blur(self) -> None:
        if self.cursor_request in self._position:
            self._refresh_rows([self._position[self.cursor_request]])
