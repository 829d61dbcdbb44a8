"""The chat's input line, which takes a multi-line paste whole.

Textual's Input keeps the first line of a paste and drops the rest without a
word (a 25-line paste became its first line). A chat must send what was pasted,
and a one-line input cannot show it: a paste of more than one line goes in as a
short marker, "[pasted 25 lines]", which can be typed around, moved or deleted
like any text, and is sent as the whole paste. ``summary()`` says what the
markers in the input hold ("25 lines, 9,424 characters"), for a line the chat
shows under the input: a longer marker scrolled its own start out of a narrow input.

"?" typed into an empty input shows the keys, as it does everywhere else: a
question rarely starts with one, and a newcomer's first "?" should do what the
footer says rather than vanish into the input.
"""

from __future__ import annotations

import itertools

from textual import events
from textual.widgets import Input


class ChatInput(Input):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._pastes: dict[str, str] = {}     # marker -> the text it stands for
        self._numbers = itertools.count(1)

    def check_consume_key(self, key: str, character: str | None) -> bool:
        """An empty input lets "?" through (see _on_key), so the keys panel does not say it needs Esc first."""
        if character == "?" and not self.value:
            return False
        return super().check_consume_key(key, character)

    def _on_key(self, event: events.Key) -> None:
        if event.character == "?" and not self.value:
            event.prevent_default()
            event.stop()
            self.app.action_show_keys()

    def _on_paste(self, event: events.Paste) -> None:
        text = event.text.replace("\r\n", "\n").replace("\r", "\n")
        if "\n" not in text.strip("\n"):
            return      # one line: Input's own handler (Textual calls it after this one) takes it
        event.prevent_default()
        event.stop()
        lines = text.strip("\n").count("\n") + 1
        marker = f"[pasted {lines} lines]"
        if marker in self._pastes and self._pastes[marker] != text:     # two different pastes of one size
            marker = f"{marker[:-1]} #{next(self._numbers)}]"
        self._pastes[marker] = text
        selection = self.selection
        if selection.is_empty:
            self.insert_text_at_cursor(marker)
        else:
            self.replace(marker, *selection)

    def expanded(self, value: str | None = None) -> str:
        """``value`` (default: what the input holds) with each paste marker left in it replaced by its paste."""
        value = self.value if value is None else value
        for marker, text in self._pastes.items():
            value = value.replace(marker, text)
        return value

    def summary(self) -> str:
        """What the paste markers now in the input stand for, in words ("" when none)."""
        held = [text for marker, text in self._pastes.items() if marker in self.value]
        if not held:
            return ""
        lines = sum(text.strip("\n").count("\n") + 1 for text in held)
        pastes = f"{len(held)} pastes: " if len(held) > 1 else "pasted "
        return f"{pastes}{lines:,} lines, {sum(map(len, held)):,} characters, sent whole"

    def clear_pastes(self) -> None:
        self._pastes.clear()
