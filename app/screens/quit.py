"""Quitting: a question when requests are still in flight, then "shutting down" until the engine thread ends.

The window never just goes blank: the engine thread finishes the step it is in
(a long prefill can take seconds on a CPU) and closes the run log, and until it
has, the screen says so.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static


class ConfirmQuit(ModalScreen[bool]):
    """Dismissed with True to quit."""

    BINDINGS = [
        Binding("y,enter,q,f10", "dismiss(True)", "Quit"),
        Binding("n,escape", "dismiss(False)", "Stay"),
    ]

    def __init__(self, in_flight: str) -> None:
        super().__init__(id="confirm-quit")
        self.in_flight = in_flight

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(f"[b]Quit kvscope?[/b]\n\n{self.in_flight} still in flight; quitting aborts "
                         "them.\n\n[b]y[/b] / Enter: quit    [b]n[/b] / Esc: stay", classes="dialog-text")


class ShuttingDown(ModalScreen[None]):
    """Shown from the moment the user quits until the engine thread has ended."""

    BINDINGS = [Binding("escape", "ignore", show=False)]

    def __init__(self) -> None:
        super().__init__(id="shutting-down")

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("[b]Shutting down…[/b]\n\nthe engine finishes its step and the run log is closed",
                         classes="dialog-text")

    def action_ignore(self) -> None:
        """Esc must not pop this screen: the app is already on its way out."""
