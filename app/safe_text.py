"""Text from outside kvscope, made safe to draw or print: the one helper every window and command uses.

Strings kvscope did not write itself (what a vLLM server answers, what a run log
holds, what a model generates) may carry control characters and markup. A C0 or
C1 control character printed to a terminal can start an escape sequence that
sets the window title, moves the cursor or writes the clipboard (OSC 52); in a
Textual window the same sequence reaches the terminal through the text drawn.
And Textual parses ``[...]`` in markup as styles and actions, so ``[/]`` ends
the window with a MarkupError and ``[@click=app.quit]`` draws a live action.

``clean`` drops every C0 and C1 control character except newline and tab (and
DEL), working on code points, so multi-byte text is never cut: a model's output
can be cleaned delta by delta as it streams. ``escape`` makes cleaned text
literal inside markup. Textual's own ``textual.markup.escape`` is not enough: it
leaves ``[$accent]``, ``[ b]`` and ``[B]`` to be parsed as styles. Where a
template takes variables (``Content.from_markup(template, name=value)``), pass
the text as a variable instead: variables are never parsed, but escaped text in
such a template would have its ``$names`` substituted.
"""

from __future__ import annotations

import re

# C0 (but newline and tab), DEL, and C1.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Textual takes ``[`` as the start of a tag unless a backslash comes right before it.
_OPEN = re.compile(r"\[")
# A backslash at the end of escaped text would escape the ``[`` of the markup that follows it.
_ZERO_WIDTH_SPACE = "\u200b"


def clean(text: object) -> str:
    """``text`` as a string without control characters (newline and tab are kept)."""
    return _CONTROL.sub("", text if isinstance(text, str) else str(text))


def one_line(text: object, limit: int | None = None) -> str:
    """``clean(text)`` on one line (runs of whitespace become one space), cut to ``limit`` characters."""
    line = " ".join(clean(text).split())
    if limit is not None and len(line) > limit:
        line = line[:max(limit - 1, 0)] + "…"
    return line


def escape(text: object) -> str:
    """``clean(text)`` made literal inside Textual markup."""
    escaped = _OPEN.sub(r"\\[", clean(text))
    return escaped + _ZERO_WIDTH_SPACE if escaped.endswith("\\") else escaped
