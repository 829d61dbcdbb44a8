"""Turns a CacheSnapshot into one small integer per map cell: which glyph, in which style.

Kept apart from the widget so the map can diff whole rows of integers with numpy
and rebuild only the rows whose cells changed. A code packs
``style * GLYPH_SLOTS + glyph``; the style says which palette colour, whether the
block is shared, and which highlight applies: the cursor, blocks a lesson
marks, the chat reply's tint, or, while a request is selected, whether the cell
is that request's (drawn as usual) or anything else (dimmed, so the selected
request's scattered blocks stand out).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope.engine.outputs import BLOCK_CACHED, BLOCK_USED, CacheSnapshot
from kvscope.themes.palette import NUM_OWNER_COLOURS

# Cell kinds, ordered by how much they matter when one cell stands for several blocks.
KIND_FREE, KIND_CACHED, KIND_USED, KIND_SHARED = 0, 1, 2, 3

FREE_GLYPH, CACHED_GLYPH = "·", "░"
FILL_GLYPHS = "▁▂▃▄▅▆▇█"  # eighths of a block's slots written
SHARED_GLYPHS = "23456789+"  # ref count of a shared block, "+" beyond nine
HIGHLIGHTED_FULL_GLYPH = "▓"  # a full block lets the chat tint behind it show through
RESERVED_GLYPH = "╌"  # held by a request but not one slot written yet (the contiguous allocator's rows)
GLYPHS = FREE_GLYPH + CACHED_GLYPH + FILL_GLYPHS + SHARED_GLYPHS + HIGHLIGHTED_FULL_GLYPH + RESERVED_GLYPH
GLYPH_SLOTS = 32
_FILL_BASE = 2
_FULL = _FILL_BASE + len(FILL_GLYPHS) - 1
_SHARED_BASE = _FILL_BASE + len(FILL_GLYPHS)
_HIGHLIGHTED_FULL = _SHARED_BASE + len(SHARED_GLYPHS)
_RESERVED = _HIGHLIGHTED_FULL + 1

# Base styles: free, cached, one per owner colour, one per owner colour when shared.
STYLE_FREE, STYLE_CACHED, STYLE_OWNER = 0, 1, 2
STYLE_SHARED = STYLE_OWNER + NUM_OWNER_COLOURS
NUM_BASE_STYLES = STYLE_SHARED + NUM_OWNER_COLOURS
OVERLAY_NONE, OVERLAY_SELECTED, OVERLAY_CHAT, OVERLAY_CURSOR, OVERLAY_DIMMED, OVERLAY_MARKED = range(6)


def decode(code: int) -> tuple[int, int, int]:
    """(base style, overlay, glyph index) of a cell code."""
    style, glyph = divmod(int(code), GLYPH_SLOTS)
    overlay, base = divmod(style, NUM_BASE_STYLES)
    return base, overlay, glyph


@dataclass(frozen=True)
class MapLayout:
    """How the pool folds into the widget: cells per row, chars per cell, blocks per cell."""

    num_blocks: int
    columns: int
    cell_width: int
    blocks_per_cell: int

    @property
    def num_cells(self) -> int:
        return -(-self.num_blocks // self.blocks_per_cell)

    @property
    def num_rows(self) -> int:
        return -(-self.num_cells // self.columns)

    def cell_at(self, x: int, y: int) -> int | None:
        column = x // self.cell_width
        cell = y * self.columns + column
        return cell if column < self.columns and 0 <= cell < self.num_cells else None

    def blocks_of(self, cell: int) -> range:
        first = cell * self.blocks_per_cell
        return range(first, min(first + self.blocks_per_cell, self.num_blocks))


CELL_WIDTHS = (4, 3, 2, 1)  # chars per cell; every width above one ends in a one-char gap


def fit_layout(num_blocks: int, width: int, height: int) -> MapLayout:
    """Widest cells that show every block; one-char cells holding several blocks when even those don't fit."""
    width, height = max(1, width), max(1, height)
    for cell_width in CELL_WIDTHS:
        columns = max(1, width // cell_width)
        if columns * height >= num_blocks:
            return MapLayout(num_blocks, columns, cell_width, 1)
    blocks_per_cell = -(-num_blocks // (width * height))
    return MapLayout(num_blocks, width, 1, blocks_per_cell)


def block_kinds(snapshot: CacheSnapshot) -> np.ndarray:
    kinds = np.zeros(snapshot.num_blocks, dtype=np.int8)
    kinds[snapshot.block_state == BLOCK_CACHED] = KIND_CACHED
    kinds[snapshot.block_state == BLOCK_USED] = KIND_USED
    kinds[(snapshot.block_state == BLOCK_USED) & (snapshot.ref_counts > 1)] = KIND_SHARED
    return kinds


def request_mask(snapshot: CacheSnapshot, request_id: str | None) -> np.ndarray | None:
    """Device blocks in any of the request's block tables, or None when it holds none."""
    if request_id is None:
        return None
    for view in snapshot.requests:
        if view.request_id == request_id:
            blocks = [b for table in view.block_tables for b in table]
            if not blocks:
                return None
            mask = np.zeros(snapshot.num_blocks, dtype=bool)
            mask[blocks] = True
            return mask
    return None


def owner_index(snapshot: CacheSnapshot) -> np.ndarray:
    """int32 [num_blocks]: arrival index of each block's first owner, -1 where unowned.

    Same answer as CacheSnapshot.owner_index, in one scatter instead of one per table.
    """
    owner = np.full(snapshot.num_blocks, -1, dtype=np.int32)
    blocks: list[int] = []
    arrivals: list[int] = []
    for view in snapshot.requests:
        for table in view.block_tables:
            blocks.extend(table)
            arrivals.extend([view.arrival_index] * len(table))
    if blocks:
        # Where several tables hold a block, the first one listed owns it.
        unique_blocks, first = np.unique(np.array(blocks, dtype=np.int64), return_index=True)
        owner[unique_blocks] = np.array(arrivals, dtype=np.int32)[first]
    return owner


def _fold(values: np.ndarray, layout: MapLayout, fill_value) -> np.ndarray:
    """[num_cells, blocks_per_cell] view of per-block values, padding the last cell."""
    padded_len = layout.num_cells * layout.blocks_per_cell
    if padded_len != values.size:
        values = np.concatenate([values, np.full(padded_len - values.size, fill_value, values.dtype)])
    return values.reshape(layout.num_cells, layout.blocks_per_cell)


def _glyphs(kinds: np.ndarray, snapshot: CacheSnapshot, layout: MapLayout) -> np.ndarray:
    """Glyph per cell. One block: its fill or ref count. Several: how many of them are in use."""
    cell_kind = kinds.max(axis=1)
    glyph = np.where(cell_kind == KIND_CACHED, 1, 0).astype(np.int32)
    used = cell_kind >= KIND_USED
    if layout.blocks_per_cell == 1:
        fill = snapshot.block_fill.astype(np.int32)
        eighths = np.clip(-(-fill * 8 // snapshot.block_size), 1, 8)
        refs = np.clip(snapshot.ref_counts.astype(np.int32), 2, 10)
        glyph[used] = np.where(fill == 0, _RESERVED, _FILL_BASE + eighths - 1)[used]
        shared = cell_kind == KIND_SHARED
        glyph[shared] = (_SHARED_BASE + refs - 2)[shared]
    else:
        in_use = (kinds >= KIND_USED).sum(axis=1)
        eighths = np.clip(-(-in_use * 8 // layout.blocks_per_cell), 1, 8)
        glyph[used] = (_FILL_BASE + eighths - 1)[used]
    return glyph


def block_mask(num_blocks: int, blocks) -> np.ndarray | None:
    """A mask of the given physical blocks (ids out of range are ignored), or None for none."""
    ids = [b for b in blocks if 0 <= b < num_blocks]
    if not ids:
        return None
    mask = np.zeros(num_blocks, dtype=bool)
    mask[ids] = True
    return mask


def cell_codes(snapshot: CacheSnapshot, layout: MapLayout, *, selected: np.ndarray | None = None,
               chat: np.ndarray | None = None, cursor: int | None = None,
               marked: np.ndarray | None = None) -> np.ndarray:
    """int32 code per cell (see module doc)."""
    kinds = _fold(block_kinds(snapshot), layout, KIND_FREE)
    owners = _fold(owner_index(snapshot), layout, -1)
    cell_kind = kinds.max(axis=1)
    # The owner a cell shows is the one of its first block in use.
    first_used = (kinds >= KIND_USED).argmax(axis=1)
    owner = owners[np.arange(layout.num_cells), first_used] % NUM_OWNER_COLOURS
    style = np.where(cell_kind == KIND_CACHED, STYLE_CACHED, STYLE_FREE).astype(np.int32)
    style = np.where(cell_kind == KIND_USED, STYLE_OWNER + owner, style)
    style = np.where(cell_kind == KIND_SHARED, STYLE_SHARED + owner, style)
    overlay = np.zeros(layout.num_cells, dtype=np.int32)
    if chat is not None:
        overlay[_fold(chat, layout, False).any(axis=1)] = OVERLAY_CHAT
    if selected is not None:
        mine = _fold(selected, layout, False).any(axis=1)
        overlay[cell_kind != KIND_FREE] = OVERLAY_DIMMED
        overlay[mine] = OVERLAY_SELECTED
    if marked is not None:
        overlay[_fold(marked, layout, False).any(axis=1)] = OVERLAY_MARKED
    if cursor is not None and 0 <= cursor < layout.num_cells:
        overlay[cursor] = OVERLAY_CURSOR
    glyph = _glyphs(kinds, snapshot, layout)
    glyph[(glyph == _FULL) & (overlay == OVERLAY_CHAT)] = _HIGHLIGHTED_FULL
    style += overlay * NUM_BASE_STYLES
    return style * GLYPH_SLOTS + glyph
