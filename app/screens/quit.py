"""Aborting requests in flight: a question first (quitting, restarting the engine, starting a lesson), then,
for quitting, "shutting down" until the engine thread ends.

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


class ConfirmAbort(ModalScreen[bool]):
    """A question before something that aborts the requests in flight (a restart, a lesson, quitting), as
    vLLM's users would want of a server: dismissed with True to go ahead."""

    BINDINGS = [
        Binding("y,enter", "dismiss(True)", "Go ahead"),
        Binding("n,escape", "dismiss(False)", "Keep them"),
    ]

    def __init__(self, question: str, in_flight: str, doing: str, *, yes: str = "go ahead",
                 no: str = "keep them running", id: str | None = "confirm-abort") -> None:
        super().__init__(id=id)
        self.question = question
        self.in_flight = in_flight
        self.text = (f"[b]{question}[/b]\n\n{in_flight} still in flight; {doing} aborts them.\n\n"
                     f"[b]y[/b] / Enter: {yes}    [b]n[/b] / Esc: {no}")

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.text, classes="dialog-text")


class ConfirmQuit(ConfirmAbort):
    """Dismissed with True to quit; q and F10 again also quit."""

    BINDINGS = [
        Binding("y,enter,q,f10", "dismiss(True)", "Quit"),
        Binding("n,escape", "dismiss(False)", "Stay"),
    ]

    def __init__(self, in_flight: str) -> None:
        super().__init__("Quit kvscope?", in_flight, "quitting", yes="quit", no="stay", id="confirm-quit")


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
