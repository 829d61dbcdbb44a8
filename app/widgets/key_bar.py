"""The footer: the keys that fit on one line, most important first, never cut.

Textual's Footer lays every binding out in a row and lets the row run off the
edge (at 80 columns the last key reads "f6Lo"). This bar takes the screen's
active bindings in order of importance (the App's, in the order it declares
them, then the screen's, then the focused widget's), keeps whole entries while
they fit, and drops the rest; "? Keys" lists everything. ``own_only`` keeps a
screen's own keys and leaves the App's out (the replay shows only its controls).
"""

from __future__ import annotations

import re

from textual.app import App
from textual.binding import Binding
from textual.content import Content
from textual.widget import Widget

SEPARATOR = "  "


NAMES = {"space": "Space", "escape": "Esc", "esc": "Esc", "tab": "Tab"}


def key_label(app: App, binding: Binding) -> str:
    """How the bar writes a key: F1 rather than f1, ^T for ctrl+t, ? for question_mark, Space, Esc."""
    display = app.get_key_display(binding)
    if re.fullmatch(r"f\d+", display):
        return display.upper()
    return NAMES.get(display.lower(), display)


def fit_entries(entries: list[tuple[str, str]], width: int) -> list[tuple[str, str]]:
    """The leading (key, label) entries whose text fits in ``width`` cells, separators included."""
    kept, used = [], 0
    for key, label in entries:
        size = len(key) + 1 + len(label) + (len(SEPARATOR) if kept else 0)
        if used + size > width:
            break
        kept.append((key, label))
        used += size
    return kept


class KeyBar(Widget):
    def __init__(self, *, own_only: bool = False, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.own_only = own_only

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, lambda _screen: self.refresh())

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def entries(self) -> list[tuple[str, str]]:
        """(key, label) of every binding shown: the App's, then the screen's, then the focused widget's.

        Read from the binding chain itself rather than ``active_bindings``, where a widget's hidden binding
        of a key (the map's Esc) would hide the screen's shown one (the replay's Esc: Back)."""
        groups: list[tuple[tuple[int, int], list[tuple[str, str]]]] = []
        seen: set[str] = set()
        for depth, (node, bindings) in enumerate(self.screen._modal_binding_chain):
            group = 0 if isinstance(node, App) else 1 if node is self.screen else 2
            if self.own_only and group == 0:
                continue
            entries = []
            for _key, binding in bindings:
                if not binding.show or binding.action in seen:
                    continue
                if self.app._check_action_state(binding.action, node) is not True:
                    continue
                seen.add(binding.action)
                entries.append((key_label(self.app, binding), binding.description))
            # The chain runs from the focused widget up to the App: the top comes first.
            groups.append(((group, -depth), entries))
        return [entry for _, entries in sorted(groups, key=lambda item: item[0]) for entry in entries]

    def render(self) -> Content:
        parts: list[Content | str] = []
        for key, label in fit_entries(self.entries(), self.size.width):
            if parts:
                parts.append(SEPARATOR)
            parts.append(Content.from_markup("[b $accent]$key[/]", key=key))
            parts.append(" " + label)
        return Content.assemble(*parts)
