"""What each glyph and colour of the block map means, in the theme's own colours."""

from __future__ import annotations

from textual.widgets import Static

from themes.palette import owner_variable

_OWNERS = "".join(f"[{'$' + owner_variable(i)}]█[/]" for i in range(4))
LEGEND = (
    f"{_OWNERS} used (colour = request)  [$block-owner-0]▁▃▆[/] partly filled  "
    f"[bold $block-shared-text on $block-owner-3]2[/] shared ×2  "
    "[$block-cached]░[/] cached, free  [$block-free]·[/] free  "
    "[$block-swapped]▚[/] swapped  [on $block-selected]  [/] selected  "
    "[on $block-chat]  [/] chat"
)


class BlockLegend(Static):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(LEGEND, id=id, classes=classes)
