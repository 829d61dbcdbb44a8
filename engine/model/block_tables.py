"""The block tables of the sequences a runner has seen, kept in one persistent int32 array.

A sequence's block table is a tuple its engine replaces whole when it changes (every block_size tokens at
most), so a row is rewritten only when the tuple a batch item carries is not the one the row was written
from. A step then costs a dictionary look-up per item and one gather, instead of flattening every table
through Python every step.

A model with KV-cache groups (engine/kv_cache_groups.py) has one BlockTables per group, each reading its
group's table of every item; a sliding group's table has NULL_BLOCK where the window freed a block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvscope.engine.batch import BatchItem
from kvscope.engine.block_pool import NULL_BLOCK

_INITIAL_ROWS = 64


class BlockTables:
    def __init__(self, width: int, group: int | None = None, sliding: bool = False) -> None:
        self.group = group          # None: the items' block_table; else their group_tables[group]
        self.sliding = sliding
        self.table = np.zeros((_INITIAL_ROWS, max(width, 1)), dtype=np.int32)
        self.lengths = np.zeros(_INITIAL_ROWS, dtype=np.int64)
        self._written: dict[int, tuple[int, tuple[int, ...]]] = {}    # seq_id -> (row, the tuple written)
        self._free = list(range(_INITIAL_ROWS - 1, -1, -1))

    def rows(self, items: Sequence[BatchItem]) -> np.ndarray:
        """The row of each item's table, written first where the table changed since it was last seen."""
        written, group = self._written, self.group
        rows = []
        for item in items:
            entry = written.get(item.seq_id)
            table = item.block_table if group is None else item.group_tables[group]
            if entry is None or entry[1] is not table:
                entry = self._write(item, table, items, entry)
            rows.append(entry[0])
        return np.array(rows, dtype=np.int64)   # one conversion: a numpy store per item costs more

    def _write(self, item: BatchItem, table: tuple[int, ...], items: Sequence[BatchItem],
               entry) -> tuple[int, tuple[int, ...]]:
        if entry is None:
            if not self._free:
                self._make_room(items)
            row = self._free.pop()
        else:
            row = entry[0]
        if len(table) > self.table.shape[1]:
            grown = np.empty((self.table.shape[0], len(table)), dtype=np.int32)
            grown[:, :self.table.shape[1]] = self.table
            grown[:, self.table.shape[1]:] = self.table[:, :1]  # every row stays padded (padded() says why)
            self.table = grown
        written = entry[1] if entry is not None else ()
        if written and len(table) > len(written) and table[:len(written)] == written:
            # The usual change: the sample took a block. The row holds the rest already, padded with the same
            # first block, so only the new entries are written (a tuple turns into numpy at ~10 ns an entry).
            self.table[row, len(written):len(table)] = table[len(written):]
        else:
            self.table[row, :len(table)] = table
            self.table[row, len(table):] = table[0] if table else 0
        self.lengths[row] = len(table)
        entry = self._written[item.seq_id] = (row, table)
        return entry

    def _make_room(self, items: Sequence[BatchItem]) -> None:
        """Forget the sequences this batch does not hold (a returning one is written again), or grow."""
        current = {item.seq_id for item in items}
        for seq_id in [s for s in self._written if s not in current]:
            self._free.append(self._written.pop(seq_id)[0])
        if not self._free:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self._free = list(range(2 * old - 1, old - 1, -1))

    def padded(self, rows: np.ndarray, context_lens: np.ndarray, block_size: int, num_blocks: int) -> np.ndarray:
        """int32 [rows, most blocks any context needs]: each row the blocks its context uses.

        Rows are padded with their own first block: masked-out keys then never come from another request's
        blocks (nor from a block of its own not written yet), so a NaN there cannot leak in through 0 * NaN.
        Every id is checked against the pool here, once per step: the C++ kernels index the pool without
        checking (torch's would raise).
        """
        needed = -(-context_lens // block_size)
        lengths = self.lengths[rows]
        if (needed > lengths).any():
            raise IndexError("a block table is shorter than its context (an engine bug)")
        width = int(needed.max())
        # Rows are kept padded past their table's end (_write), so a row whose context needs its whole table is
        # ready as it is; only a table holding blocks past its context (reserved, not written yet) is padded here.
        padded = self.table[rows, :width]
        if (needed < lengths).any():
            padded = np.where(np.arange(width)[None, :] < needed[:, None], padded, padded[:, :1])
        if self.sliding:
            # The kernels never read the entries of blocks the window freed; they get the row's first block still
            # held there all the same (written whole, as above), so no id outside the pool reaches a kernel.
            num_freed = np.argmax(padded != NULL_BLOCK, axis=1)    # freed entries lead; a row's last is held
            first_held = padded[np.arange(len(rows)), num_freed]
            padded = np.where(padded == NULL_BLOCK, first_held[:, None], padded)
        if padded.min() < 0 or padded.max() >= num_blocks:
            raise IndexError(f"a block table names a block outside the pool of {num_blocks} (an engine bug)")
        return padded
