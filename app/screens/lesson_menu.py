"""The list of lessons: pick one with the arrows and Enter (what `kvscope lesson` with no name opens)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from kvscope.app.lessons import LESSONS


class LessonMenu(ModalScreen[str | None]):
    """Dismissed with the chosen lesson's name, or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="lesson-menu"):
            yield Static("[b]Lessons[/b] · each runs the real model on a small teaching pool and pauses at "
                         "the moments worth seeing. Enter starts one.", classes="dialog-text")
            yield OptionList(*(Option(f"[b]{lesson.name}[/b]\n{lesson.summary}", id=lesson.name)
                               for lesson in LESSONS.values()), id="lesson-options")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)
