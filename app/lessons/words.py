"""How a lesson's captions put figures into words: block tables as arrows, plurals, percentages, bars.

Captions are read aloud to a class from a projector at 120x40, so every helper here keeps to the lesson
panel's width and says a measured difference only when it is larger than a busy machine's noise.
"""

from __future__ import annotations

from kvscope.app.widgets.formatting import bar


def arrows(blocks) -> str:
    """A block table as the class reads it: 12 → 40 → 7."""
    return " → ".join(str(b) for b in blocks) or "(no blocks)"


def plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


# The lesson panel's text width at 120x40, the size a class projects: a table or a bar chart wider than this
# wraps into nonsense there, where prose merely wraps.
CAPTION_WIDTH = 42
# A measured difference smaller than this share of the larger figure is not told as an effect: a busy CPU's step
# times vary by that much from run to run, and a step's fixed cost can be most of a small step.
NOISE = 0.15


def compared(a: float, b: float, noise: float = NOISE) -> int:
    """+1 when ``b`` is above ``a`` by more than ``noise`` of the larger, -1 when below, 0 within it: what a
    caption may say of two measured figures."""
    top = max(abs(a), abs(b))
    if top == 0 or abs(b - a) <= noise * top:
        return 0
    return 1 if b > a else -1


def bars(rows: list[tuple[str, float, str]], width: int | None = None) -> list[str]:
    """A horizontal bar chart: one "label ██████▌ value" line per (label, amount, value text), the longest bar
    ``width`` cells (default: what CAPTION_WIDTH leaves beside the labels and values), so amounts read against
    each other at a glance."""
    longest = max((amount for _, amount, _ in rows), default=0) or 1
    label_width = max(len(label) for label, _, _ in rows)
    if width is None:
        width = max(4, CAPTION_WIDTH - label_width - 2 - max(len(value) for _, _, value in rows))
    return [f"{label:<{label_width}} [$accent]{bar(amount / longest, width)}[/] {value}"
            for label, amount, value in rows]


SPARKS = "▁▂▃▄▅▆▇█"


def spark(values: list[float]) -> str:
    """A one-line plot of ``values``, one cell each, the largest a full cell."""
    top = max(values, default=0) or 1
    return "".join(SPARKS[min(len(SPARKS) - 1, round(v / top * (len(SPARKS) - 1)))] for v in values)


def figures(rows: list[tuple[str, str]], note: str = "") -> str:
    """The closing figures: "label  value" lines, labels padded to the longest, then a sentence."""
    width = max(len(label) for label, _ in rows)
    # A value too long for its row goes under its label, indented, rather than wrapping under the labels.
    lines = [f"{label:<{width}}  {value}" if width + 2 + len(value) <= CAPTION_WIDTH else f"{label}\n  {value}"
             for label, value in rows]
    return "[b]The figures of this run[/b]\n" + "\n".join(lines) + (f"\n\n{note}" if note else "")
