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
from typing import NamedTuple

import numpy as np

from kvscope.app.widgets.map_aggregates import (
    KIND_CACHED,
    KIND_FREE,
    KIND_SHARED,
    KIND_USED,
    MapAggregates,
    first_in_use,
)
from kvscope.engine.outputs import CacheSnapshot
from kvscope.themes.palette import NUM_OWNER_COLOURS

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


class Cells(NamedTuple):
    """What the codes are made of, per cell: its most important kind of block, the owner of its first block in
    use (-1: none), how many of its blocks are in use, and, where a cell is one block, that block's fill and ref
    count (None otherwise)."""

    kind: np.ndarray
    owner: np.ndarray
    in_use: np.ndarray
    blocks_per_cell: int
    fill: np.ndarray | None = None
    refs: np.ndarray | None = None


def pool_cells(aggregates: MapAggregates) -> Cells:
    """The whole pool, ``aggregates.blocks_per_cell`` blocks a cell: O(cells)."""
    one = aggregates.blocks_per_cell == 1
    n = aggregates.num_cells
    return Cells(aggregates.cell_kinds(), aggregates.cell_owners(), aggregates.cells_in_use(),
                 aggregates.blocks_per_cell, aggregates.fill[:n] if one else None,
                 aggregates.refs[:n] if one else None)


def block_cells(aggregates: MapAggregates, blocks: np.ndarray, blocks_per_cell: int = 1) -> Cells:
    """The given blocks (a region, or one request's table) in order, ``blocks_per_cell`` a cell: O(len(blocks))."""
    kind = aggregates.kind[blocks]
    if blocks_per_cell == 1:
        return Cells(kind, aggregates.owner[blocks], (kind >= KIND_USED).astype(np.int32), 1,
                     aggregates.fill[blocks], aggregates.refs[blocks])
    padding = -blocks.size % blocks_per_cell
    rows = np.concatenate([kind, np.full(padding, KIND_FREE, np.int8)]).reshape(-1, blocks_per_cell)
    owners = np.concatenate([aggregates.owner[blocks], np.full(padding, -1, np.int32)]).reshape(rows.shape)
    first = first_in_use(rows, blocks_per_cell)
    owner = np.where(first < blocks_per_cell, owners[np.arange(rows.shape[0]), np.minimum(first, blocks_per_cell - 1)],
                     -1)
    return Cells(rows.max(axis=1), owner, (rows >= KIND_USED).sum(axis=1), blocks_per_cell)


def _glyphs(cells: Cells, block_size: int) -> np.ndarray:
    """Glyph per cell. One block: its fill or ref count. Several: how many of them are in use."""
    cell_kind = cells.kind
    glyph = np.where(cell_kind == KIND_CACHED, 1, 0).astype(np.int32)
    used = cell_kind >= KIND_USED
    if cells.fill is not None:
        fill = cells.fill.astype(np.int32)
        eighths = np.clip(-(-fill * 8 // block_size), 1, 8)
        refs = np.clip(cells.refs.astype(np.int32), 2, 10)
        glyph[used] = np.where(fill == 0, _RESERVED, _FILL_BASE + eighths - 1)[used]
        shared = cell_kind == KIND_SHARED
        glyph[shared] = (_SHARED_BASE + refs - 2)[shared]
    else:
        eighths = np.clip(-(-cells.in_use * 8 // cells.blocks_per_cell), 1, 8)
        glyph[used] = (_FILL_BASE + eighths - 1)[used]
    return glyph


def codes(cells: Cells, block_size: int, *, selected: np.ndarray | None = None, chat: np.ndarray | None = None,
          cursor: int | None = None, marked: np.ndarray | None = None) -> np.ndarray:
    """int32 code per cell (see module doc). ``selected``, ``chat``, ``marked``: the indices of the cells holding
    the selected request's, the chat reply's and the marked blocks (None: no such request or mark)."""
    cell_kind = cells.kind
    owner = cells.owner % NUM_OWNER_COLOURS
    style = np.where(cell_kind == KIND_CACHED, STYLE_CACHED, STYLE_FREE).astype(np.int32)
    style = np.where(cell_kind == KIND_USED, STYLE_OWNER + owner, style)
    style = np.where(cell_kind == KIND_SHARED, STYLE_SHARED + owner, style)
    overlay = np.zeros(cell_kind.size, dtype=np.int32)
    if chat is not None:
        overlay[chat] = OVERLAY_CHAT
    if selected is not None:
        overlay[cell_kind != KIND_FREE] = OVERLAY_DIMMED
        overlay[selected] = OVERLAY_SELECTED
    if marked is not None:
        overlay[marked] = OVERLAY_MARKED
    if cursor is not None and 0 <= cursor < cell_kind.size:
        overlay[cursor] = OVERLAY_CURSOR
    glyph = _glyphs(cells, block_size)
    glyph[(glyph == _FULL) & (overlay == OVERLAY_CHAT)] = _HIGHLIGHTED_FULL
    style += overlay * NUM_BASE_STYLES
    return style * GLYPH_SLOTS + glyph


def request_blocks(snapshot: CacheSnapshot, request_id: str | None) -> np.ndarray | None:
    """The device blocks in the request's block tables, in table order (a block shared by its samples once),
    or None when it holds none or is not in the snapshot."""
    if request_id is None:
        return None
    for view in snapshot.requests:
        if view.request_id == request_id:
            blocks = list(dict.fromkeys(b for table in view.block_tables for b in table))
            return np.array(blocks, dtype=np.int64) if blocks else None
    return None


def pool_cells_of(blocks: np.ndarray | None, layout: MapLayout) -> np.ndarray | None:
    """The overview's cells holding any of ``blocks``."""
    return None if blocks is None else np.unique(blocks // layout.blocks_per_cell)


def cell_codes(snapshot: CacheSnapshot, layout: MapLayout, *, selected: str | None = None, chat: str | None = None,
               cursor: int | None = None, marked=()) -> np.ndarray:
    """The whole pool's codes recounted from ``snapshot`` alone (the widget keeps its counts up to date instead):
    ``selected`` and ``chat`` are request ids, ``marked`` block ids."""
    aggregates = MapAggregates(snapshot.num_blocks, layout.blocks_per_cell)
    aggregates.update(snapshot)
    marked_blocks = np.array([b for b in marked if 0 <= b < snapshot.num_blocks], dtype=np.int64)
    return codes(pool_cells(aggregates), snapshot.block_size,
                 selected=pool_cells_of(request_blocks(snapshot, selected), layout),
                 chat=pool_cells_of(request_blocks(snapshot, chat), layout), cursor=cursor,
                 marked=pool_cells_of(marked_blocks if marked_blocks.size else None, layout))
