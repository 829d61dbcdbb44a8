"""One attached pool's block map: the app's BlockMap, which also says which pool its cursor is in."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from kvscope.app.messages import BlockHighlighted
from kvscope.app.widgets.block_map import BlockMap


@dataclass
class SlotHighlighted(Message):
    """The cursor of ``pool_map`` moved to ``slot``."""

    pool_map: PoolMap
    slot: int


class PoolMap(BlockMap):
    def __init__(self, pool_index: int, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.pool_index = pool_index

    def on_block_highlighted(self, message: BlockHighlighted) -> None:
        # BlockMap says which blocks, not which map: with one map per rank the screen needs both.
        message.stop()
        self.post_message(SlotHighlighted(self, message.first_block))
