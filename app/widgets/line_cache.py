"""LineCache: the rendered lines of a line-API widget, kept until what one of them draws changes.

The block map, the queues and the throughput panel draw through ``render_line``, which Textual calls for
every visible line of every repaint. Each keeps the Strip it rendered for a line (a map row, a request's
row, a series) and renders it again only after ``drop`` (that line's data changed) or ``clear`` (a resize,
a theme, a new layout): a step that changes three rows re-renders three.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from textual.strip import Strip

K = TypeVar("K", bound=Hashable)


class LineCache(Generic[K]):
    def __init__(self, render: Callable[..., Strip]) -> None:
        """``render(key, *args)`` draws the line ``key`` names."""
        self._render = render
        self._strips: dict[K, Strip] = {}

    def line(self, key: K, *args) -> Strip:
        """The line's Strip, rendered now only when it is not kept."""
        strip = self._strips.get(key)
        if strip is None:
            strip = self._strips[key] = self._render(key, *args)
        return strip

    def drop(self, key: K) -> None:
        """What this line draws changed: render it again when it is next asked for."""
        self._strips.pop(key, None)

    def clear(self) -> None:
        self._strips.clear()
