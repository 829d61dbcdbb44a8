"""A layout container that draws nothing of its own.

Every repaint pass renders each widget whose region overlaps what changed, all of
its lines, and the containers around the panels overlap everything. A BLANK
widget (Textual's switch for widgets with no border and no content) skips the
styles pass and hands back blank lines in its background colour, which the
panels on top of it cover anyway. Layout direction and sizes come from the
style sheet (``Box`` is vertical, ``Box.row`` horizontal). ``titled`` is the
other half of laying out a panel: its title goes on its border.
"""

from __future__ import annotations

from typing import TypeVar

from textual.widget import Widget

W = TypeVar("W", bound=Widget)


class Box(Widget):
    BLANK = True


def titled(widget: W, title: str) -> W:
    """The widget with ``title`` on its border (every panel has one)."""
    widget.border_title = title
    return widget
