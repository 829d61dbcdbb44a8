"""The lesson's words beside the map: which beat this is, what just happened, and the keys to go on."""

from __future__ import annotations

from textual.markup import escape

from kvscope.app.widgets.line_panel import LinePanel

KEYS = "[dim]Space: next · Backspace: back · Esc: leave the lesson[/]"
LAST_KEYS = "[dim]The end of the lesson · Backspace: back · Esc: leave the lesson[/]"


class LessonPanel(LinePanel, can_focus=True):
    """Focusable so a long caption (the closing figures) can be scrolled with the keys."""

    def show_beat(self, number: int, total: int, title: str, caption: str, note: str = "") -> None:
        lines = [f"[b $accent]{number}/{total} · {escape(title)}[/]", "", caption]
        if note:
            lines += ["", f"[dim]{note}[/]"]
        self.show("\n".join([*lines, "", LAST_KEYS if number == total else KEYS]))
        self.scroll_home(animate=False)

    def show_running(self, number: int, total: int, title: str) -> None:
        self.show(f"[b $accent]{number}/{total} · {escape(title)}[/]\n\n[dim]▶ the engine is running to this "
                  f"moment…[/]\n\n{KEYS}")
