"""The lesson's words beside the map: which beat this is, what just happened, and the keys to go on."""

from __future__ import annotations

from textual.markup import escape

from kvscope.app.widgets.line_panel import LinePanel

KEYS = "[dim]Space: next · Backspace: back · Esc: leave the lesson[/]"
LAST_KEYS = "[dim]The end of the lesson · Backspace: back · Esc: leave the lesson[/]"


MORE = "↓ more: ↓ or PgDn"


class LessonPanel(LinePanel, can_focus=True):
    """Focusable so a long caption (the closing figures) can be scrolled with the keys; while more of it is
    below the panel, its bottom edge says so and names the keys (at 120x40 a closing paragraph is below the fold,
    and nothing said it was there)."""

    def show_beat(self, number: int, total: int, title: str, caption: str, note: str = "") -> None:
        lines = [f"[b $accent]{number}/{total} · {escape(title)}[/]", "", caption]
        if note:
            lines += ["", f"[dim]{note}[/]"]
        self.show("\n".join([*lines, "", LAST_KEYS if number == total else KEYS]))
        self.scroll_home(animate=False)
        self.call_after_refresh(self._cue_more)

    @property
    def more_below(self) -> bool:
        return round(self.scroll_y) < self.max_scroll_y

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self._cue_more()

    def on_resize(self) -> None:
        self.call_after_refresh(self._cue_more)

    def watch_virtual_size(self) -> None:
        # Text that re-wraps to more or fewer rows without the panel resizing (a scrollbar taking a column, a
        # theme change) moves the bottom too: the cue from the last resize or beat would be stale. The new height
        # is known now, so cue at once (a reader of the panel never sees the two disagree), and again once the
        # refresh has settled the scroll offset against it.
        self._cue_more()
        self.call_after_refresh(self._cue_more)

    def _cue_more(self) -> None:
        self.border_subtitle = MORE if self.more_below else ""

    def show_running(self, number: int, total: int, title: str) -> None:
        self.show(f"[b $accent]{number}/{total} · {escape(title)}[/]\n\n[dim]▶ the engine is running to this "
                  f"moment…[/]\n\n{KEYS}")
