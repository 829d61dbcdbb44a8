"""The block map's views, as its caption names them, and the key that tells KV-cache groups apart.

Why a selector key and not a colour per group: the colour of a cell already says which request holds the block,
the map's first question, and a class at 120x40 reads cells two to four characters wide, with no room for a
second mark. A second palette on the same cells would make every cell answer two questions at once. So ``w``
shows one attention kind at a time ("full attention", then "sliding window 512", then the whole pool again):
that kind's blocks keep their request colours and everything else dims, as it does when a request is selected,
so a sliding window's few blocks, and the ones it gives back as the request advances, stand out. Groups of one
kind (Gemma 3's five sliding groups) show together (group_kinds.py). A pool with one group has no such key in
the key bar and looks as it always did.

A mixin of BlockMap, kept apart so that the widget's file stays about drawing the cells.
"""

from __future__ import annotations

import numpy as np

from kvscope.app.messages import AttentionKindShown
from kvscope.app.widgets.group_kinds import attention_kinds, kind_name


class GroupSelector:
    """Needs ``snapshot``, ``map_layout``, ``shown_blocks``, ``focused_request``, ``zoom_start``, ``_aggregates``
    and ``_recompute``; sets ``shown_kind`` (None: every kind)."""

    shown_kind: int | None = None
    _has_kinds = False

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "next_kind":   # the key bar offers it only for a pool with groups
            return self._has_kinds
        return super().check_action(action, parameters)

    def _follow_kinds(self, snapshot) -> None:
        """A new snapshot: another engine's pool may have groups where the last had none, or other kinds."""
        has_kinds = bool(snapshot.kv_cache_groups)
        if has_kinds != self._has_kinds:
            self._has_kinds, self.shown_kind = has_kinds, None
            self.map_layout = None      # draws everything again, the caption too
            self.refresh_bindings()

    def action_next_kind(self) -> None:
        """The next attention kind's blocks alone; after the last, the whole pool again."""
        kinds = attention_kinds(self.snapshot.kv_cache_groups) if self.snapshot is not None else ()
        if not kinds:
            self.app.bell()
            return
        kind = self.shown_kind
        self.shown_kind = 0 if kind is None else (kind + 1 if kind + 1 < len(kinds) else None)
        self._recompute()
        if self.map_layout is not None:
            self.border_subtitle = self._caption()
        self.post_message(AttentionKindShown(self.shown_kind))

    def _kind_cells(self, layout) -> np.ndarray | None:
        """The cells holding blocks of the shown kind (None: every kind shows)."""
        aggregates, kind = self._aggregates, self.shown_kind
        if kind is None or aggregates is None or kind >= aggregates.num_kinds:
            return None
        if self.shown_blocks is None:
            return aggregates.cells_of_kind(kind)
        return np.unique(np.flatnonzero(aggregates.counted_kind[self.shown_blocks] == kind) // layout.blocks_per_cell)

    def _with_kind(self, selected: np.ndarray | None, layout) -> np.ndarray | None:
        """The cells to draw as selected: the selected request's, of the shown kind only."""
        kind_cells = self._kind_cells(layout)
        if kind_cells is None:
            return selected
        return kind_cells if selected is None else np.intersect1d(selected, kind_cells)

    def _caption(self) -> str:
        layout, total = self.map_layout, self.snapshot.num_blocks
        if self.focused_request is not None:
            if not layout.num_blocks:
                return f"{self.focused_request} holds no device blocks now · f: whole pool"
            caption = f"{self.focused_request}: {layout.num_blocks:,} blocks in table order · f: whole pool"
        elif self.zoom_start is not None:
            last = self.zoom_start + layout.num_blocks - 1
            caption = f"blocks {self.zoom_start:,}-{last:,} of {total:,} · 1 cell = 1 block · z: whole pool"
        else:
            per_cell = "1 cell = 1 block" if layout.blocks_per_cell == 1 else \
                f"1 cell = {layout.blocks_per_cell} blocks (pool larger than the panel)"
            caption = f"{layout.num_blocks:,} blocks · {per_cell}"
        return caption + self._kind_caption()

    def _kind_caption(self) -> str:
        kinds = attention_kinds(self.snapshot.kv_cache_groups)
        if not kinds:
            return ""
        if self.shown_kind is None or self.shown_kind >= len(kinds):
            return " · w: one attention kind"
        return f" · {kind_name(kinds[self.shown_kind])} only · w: next"
