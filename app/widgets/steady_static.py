"""A Static for panels that redraw every frame: it asks for a layout pass only when its line count changes.

A layout pass re-arranges and repaints the whole screen; a plain refresh repaints
only this widget. The panels using it have heights fixed in the style sheet, so
a changed line count is the only change that can matter to the layout.
"""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static


class SteadyStatic(Static):
    def __init__(self, content: str = "", *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(content, id=id, classes=classes)
        self._shown: Content | None = None

    def show(self, content: Content) -> None:
        """Show ``content`` (a no-op when unchanged), with a layout pass only if its line count changed."""
        if content == self._shown:
            return
        lines_changed = self._shown is None or content.plain.count("\n") != self._shown.plain.count("\n")
        self._shown = content
        self.update(content, layout=lines_changed)
