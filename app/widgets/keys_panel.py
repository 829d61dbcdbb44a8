"""The "?" panel: every key that works now, the window's own first, scrollable from the keyboard.

Textual's help panel lists the focused widget's bindings first: with the chat input focused, that was the
input's 31 text-editing keys, and the window's own keys fell below the bottom of a 40-row terminal in a panel
no key could scroll. This panel lists the window's keys first (a letter key that the focused input takes as
text says so), then the screen's, then the focused panel's own, and folds the editing keys of a text input into
one paragraph. It takes the focus while open, so arrows, PgUp/PgDn and Home/End scroll it; Esc or ? closes it
and gives the focus back.
"""

from __future__ import annotations

from textual.app import App
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.dom import DOMNode
from textual.keys import key_to_character
from textual.widget import Widget
from textual.widgets import Input, Static, TextArea

from kvscope.app.widgets.key_bar import key_label

EDITING_WIDGETS = (Input, TextArea)


def _editing_actions() -> set[str]:
    """The actions Textual's own text inputs bind: typing, moving, selecting, deleting, the clipboard."""
    actions = set()
    for widget_class in EDITING_WIDGETS:
        for binding in widget_class.BINDINGS:
            actions.add(binding.action if isinstance(binding, Binding) else binding[1])
    return actions


def key_rows(app: App, screen, focused: Widget | None) -> list[tuple[str, str, str]]:
    """(section, keys, what they do) for every key that works with ``focused`` in focus, the App's first."""
    editing = _editing_actions()
    chain: list[DOMNode] = list(focused.ancestors_with_self) if focused is not None else [screen, app]
    widgets = [node for node in chain if node is not app and node is not screen]
    order = [(app, "keys of the window"), (screen, "keys of this screen")] + [(node, "keys of the panel in focus")
                                                                            for node in widgets]
    rows: list[tuple[str, str, str]] = []
    folded: list[str] = []
    seen: set[str] = set()
    for node, section in order:
        by_action: dict[str, list[Binding]] = {}
        for binding in (b for bound in node._bindings.key_to_bindings.values() for b in bound):
            if isinstance(node, EDITING_WIDGETS) and binding.action in editing:
                folded.append(key_label(app, binding))
                continue
            if not binding.show or binding.action in seen:
                continue
            by_action.setdefault(binding.action, []).append(binding)
        for action, bindings in by_action.items():
            seen.add(action)
            first = bindings[0]
            keys = " ".join(dict.fromkeys(key_label(app, binding) for binding in bindings))
            what = first.tooltip or first.description or action.replace("_", " ")
            if node is app and focused is not None and all(
                    focused.check_consume_key(binding.key, key_to_character(binding.key)) for binding in bindings):
                what += " (Esc out of the input first)"
            rows.append((section, keys, what))
    if folded:
        rows.append(("text editing in the input", f"{len(dict.fromkeys(folded))} keys",
                     " ".join(dict.fromkeys(folded))))
    return rows


class KeysPanel(VerticalScroll):
    """Mounted on the screen by the App's "?" (show_keys), removed by it or by Esc."""

    DEFAULT_CSS = """
    KeysPanel {
        split: right;
        width: 36%;
        min-width: 34;
        max-width: 64;
        height: 100%;
        border-left: vkey $foreground 30%;
        padding: 0 1;
        background: $surface;
    }
    KeysPanel:focus { border-left: vkey $accent; }
    KeysPanel > .keys-section { color: $text-primary; text-style: underline; margin-top: 1; }
    KeysPanel > .keys-row { height: auto; }
    """
    BINDINGS = [Binding("escape", "close", "Close keys")]

    def __init__(self, rows: list[tuple[str, str, str]], give_focus_back: Widget | None) -> None:
        super().__init__(id="keys-panel", can_focus=True)
        self.rows = rows
        self.give_focus_back = give_focus_back

    def compose(self):
        yield Static(Content.from_markup("[dim]↑↓ PgUp PgDn scroll · Esc or ? closes[/]"))
        section = None
        for row_section, keys, what in self.rows:
            if row_section != section:
                section = row_section
                yield Static(section[0].upper() + section[1:], classes="keys-section")
            yield Static(Content.from_markup("[b $accent]$keys[/]  $what", keys=keys, what=what), classes="keys-row")

    def on_mount(self) -> None:
        self.focus()

    def action_close(self) -> None:
        back = self.give_focus_back
        self.remove()
        if back is not None and back.is_attached:
            back.focus()


def toggle_keys_panel(app: App) -> None:
    """Open the "?" panel on the screen in front, or close it where it is open."""
    screen = app.screen
    panels = screen.query(KeysPanel)
    if panels:
        panels.first().action_close()
        return
    focused = screen.focused
    screen.mount(KeysPanel(key_rows(app, screen, focused), focused))
