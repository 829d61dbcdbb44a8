"""The footer: the keys that fit on one line, most important first, never cut.

Textual's Footer lays every binding out in a row and lets the row run off the
edge (at 80 columns the last key reads "f6Lo"). This bar takes the screen's
active bindings (the App's, in the order it declares them, then the screen's,
then the focused widget's), keeps whole entries while they fit, the most needed
first, and shows them in that order; "? Keys" lists everything. ``keep_first``
ranks the actions (the App's list, app/actions.py FOOTER_RANKS): those not in it
come after the ranked ones, except where the list holds OWN_KEYS, which ranks
the screen's and the focused widget's own keys there. ``own_only`` keeps a
screen's own keys and leaves the App's out (the replay shows only its controls).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from textual.app import App
from textual.binding import Binding
from textual.content import Content
from textual.widget import Widget

SEPARATOR = "  "
OWN_KEYS = "*"      # in keep_first: where the screen's and the focused widget's own keys rank


NAMES = {"space": "Space", "escape": "Esc", "esc": "Esc", "tab": "Tab"}


def key_label(app: App, binding: Binding) -> str:
    """How the bar writes a key: F1 rather than f1, ^T for ctrl+t, ? for question_mark, Space, Esc."""
    display = app.get_key_display(binding)
    if re.fullmatch(r"f\d+", display):
        return display.upper()
    return NAMES.get(display.lower(), display)


def fit_entries(entries: list[tuple[str, str]], width: int,
                ranks: Sequence[int] | None = None) -> list[tuple[str, str]]:
    """The (key, label) entries that fit in ``width`` cells, separators included, in their order: taken by
    ``ranks`` (lowest first; default: their order) until the next one does not fit."""
    order = sorted(range(len(entries)), key=lambda i: (ranks[i], i) if ranks is not None else i)
    kept: set[int] = set()
    used = 0
    for index in order:
        key, label = entries[index]
        size = len(key) + 1 + len(label) + (len(SEPARATOR) if kept else 0)
        if used + size > width:
            break
        kept.add(index)
        used += size
    return [entry for index, entry in enumerate(entries) if index in kept]


class KeyBar(Widget):
    def __init__(self, *, own_only: bool = False, keep_first: Sequence[str] = (), id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.own_only = own_only
        self.keep_first = tuple(keep_first)

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, lambda _screen: self.refresh())

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def entries(self) -> list[tuple[str, str]]:
        """(key, label) of every binding shown: the App's, then the screen's, then the focused widget's."""
        return [(key, label) for key, label, _rank in self.ranked_entries()]

    def ranked_entries(self) -> list[tuple[str, str, int]]:
        """(key, label, rank) of every binding shown, in the order entries() gives.

        Read from the binding chain itself rather than ``active_bindings``, where a widget's hidden binding
        of a key (the map's Esc) would hide the screen's shown one (the replay's Esc: Back)."""
        unranked = len(self.keep_first)
        own_rank = self.keep_first.index(OWN_KEYS) if OWN_KEYS in self.keep_first else unranked
        groups: list[tuple[tuple[int, int], list[tuple[str, str, int]]]] = []
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
                if group == 0:
                    rank = self.keep_first.index(binding.action) if binding.action in self.keep_first else unranked
                else:
                    rank = own_rank
                entries.append((key_label(self.app, binding), binding.description, rank))
            # The chain runs from the focused widget up to the App: the top comes first.
            groups.append(((group, -depth), entries))
        return [entry for _, entries in sorted(groups, key=lambda item: item[0]) for entry in entries]

    def render(self) -> Content:
        parts: list[Content | str] = []
        ranked = self.ranked_entries()
        entries = [(key, label) for key, label, _rank in ranked]
        for key, label in fit_entries(entries, self.size.width, [rank for _key, _label, rank in ranked]):
            if parts:
                parts.append(SEPARATOR)
            parts.append(Content.from_markup("[b $accent]$key[/]", key=key))
            parts.append(" " + label)
        return Content.assemble(*parts)
