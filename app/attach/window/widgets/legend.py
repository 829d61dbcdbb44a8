"""What a cell of an attached pool means: announced blocks by prefix tree, the usage band, and the rest."""

from __future__ import annotations

from textual.events import Resize
from textual.widgets import Static

from kvscope.app.widgets.block_legend import GAP, legend_lines
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable

_TREES = "".join(f"[${owner_variable(i)}]█[/]" for i in range(4))
BAND_VARIABLE = owner_variable(NUM_OWNER_COLOURS - 1)   # the map draws unowned used cells in the last colour
ITEMS = (
    f"{_TREES} announced block (colour = prefix tree; in use or cached, vLLM does not say which)",
    f"[${BAND_VARIABLE}]╌[/] in use, never announced (partly filled): counted from kv_cache_usage_perc",
    "[$block-free]·[/] free, or not known from events",
    "[on $block-cursor] [/] cursor",
)


class AttachLegend(Static):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(GAP.join(ITEMS), id=id, classes=classes)

    def on_resize(self, event: Resize) -> None:
        self.update("\n".join(legend_lines(self.size.width, ITEMS)))
