"""What each glyph and colour of the block map means, in the theme's own colours.

The items are packed into lines for the current width and a line only ever
breaks between two items, so a swatch never ends one line with its words on the next.
With KV-cache groups one more item names the attention kinds the map's ``w`` key
steps through, the one shown marked.
"""

from __future__ import annotations

from rich.cells import cell_len
from textual.content import Content
from textual.events import Resize
from textual.widgets import Static

from kvscope.app.widgets.group_kinds import kind_name
from kvscope.themes.palette import owner_variable

_OWNERS = "".join(f"[${owner_variable(i)}]█[/]" for i in range(4))
ITEMS = (
    f"{_OWNERS} in use (colour = request)",
    "[$block-owner-0]▁▃▆[/] partly filled",
    "[$block-owner-0]╌[/] reserved, empty",
    "[bold $block-shared-text on $block-owner-3]2[/] shared by 2 ([bold $block-shared-text on $block-owner-3]+[/] 10+)",
    "[$block-cached]░[/] cached, free",
    "[$block-free]·[/] free",
    "[$block-swapped]▚[/] swapped out",
    "[on $block-cursor] [/] cursor",
    "[$block-owner-1 on $block-chat]▓[/] chat reply",
)
GAP = "  "


def kinds_item(kinds: tuple[int | None, ...], shown: int | None) -> str:
    """The legend's item for a pool with groups: "w groups: full attention · sliding window 512", the shown kind
    in reverse."""
    names = [f"[reverse]{kind_name(w)}[/]" if i == shown else kind_name(w) for i, w in enumerate(kinds)]
    return "[b $accent]w[/] groups: " + " · ".join(names)


def legend_lines(width: int, items: tuple[str, ...] = ITEMS) -> list[str]:
    """The items as markup lines of at most ``width`` cells (an item wider than that gets a line alone)."""
    lines: list[list[str]] = []
    used = 0
    for item in items:
        size = cell_len(Content.from_markup(item).plain)
        if lines and used + len(GAP) + size <= width:
            lines[-1].append(item)
            used += len(GAP) + size
        else:
            lines.append([item])
            used = size
    return [GAP.join(line) for line in lines]


class BlockLegend(Static):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__("\n".join(legend_lines(10_000)), id=id, classes=classes)
        self.items = ITEMS

    def show_kinds(self, kinds: tuple[int | None, ...], shown: int | None) -> None:
        """The pool's attention kinds (none: one group, the legend as ever) and the one the map shows alone."""
        items = (*ITEMS, kinds_item(kinds, shown)) if kinds else ITEMS
        if items != self.items:
            self.items = items
            self.update("\n".join(legend_lines(self.size.width or 10_000, items)))

    def on_resize(self, event: Resize) -> None:
        self.update("\n".join(legend_lines(self.size.width, self.items)))
