"""The block map's copy of the pool, and its per-cell counts, kept up to date from each step's block changes.

A pool of 340,000 blocks folds into a few hundred cells, and a frame cannot afford to look at every block (or
every block-table entry) again: that took a quarter of a second. The engine publishes what each step changed
(engine/block_changes.py); this applies those changes to its own copy of the per-block state and to per-cell
counts of each kind of block, and follows each request's block tables by what they gained or lost since the
last frame. A frame then costs the changes since the one before plus O(cells). The whole arrays are read
only where the chain of changes is broken: the first frame, another engine, a replay's jump, a keyframe that
does not say what changed.

A block's owner (its colour) is the earliest-arriving request holding it, whatever order the queues list
requests in, so it can be kept from the tables' differences alone; a cell shows the owner of its first block
in use.

With KV-cache groups each held block also has an attention kind (group_kinds.py: a block serves one group, and
keeps it while held), taken from the tables of the requests that changed, and each cell counts its held blocks
of each kind, so the map can show one kind's blocks in O(cells) a frame.
"""

from __future__ import annotations

import itertools

import numpy as np

from kvscope.app.widgets.group_kinds import attention_kinds, kind_of_group
from kvscope.engine.outputs import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_USED,
    NULL_BLOCK,
    BlockArrays,
    CacheSnapshot,
    RequestView,
)

# Cell kinds, ordered by how much they matter when one cell stands for several blocks.
KIND_FREE, KIND_CACHED, KIND_USED, KIND_SHARED = 0, 1, 2, 3
NUM_KINDS = 4


def kinds_of(state: np.ndarray, refs: np.ndarray) -> np.ndarray:
    """int8 kind of each block from its state and ref count."""
    kinds = np.zeros(state.shape, dtype=np.int8)
    kinds[state == BLOCK_CACHED] = KIND_CACHED
    used = state == BLOCK_USED
    kinds[used] = KIND_USED
    kinds[used & (refs > 1)] = KIND_SHARED
    return kinds


def first_in_use(kinds: np.ndarray, width: int) -> np.ndarray:
    """Per row of ``kinds`` (rows of ``width`` blocks): the offset of its first block in use, ``width`` if none."""
    in_use = kinds >= KIND_USED
    first = in_use.argmax(axis=1).astype(np.int32)
    first[~in_use.any(axis=1)] = width
    return first


def held_blocks(block_tables: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """The device blocks in a request's tables, each once (samples of one request share blocks)."""
    tables = [t for t in block_tables if t]
    if not tables:
        return np.zeros(0, dtype=np.int64)
    if len(tables) == 1:
        return np.array(tables[0], dtype=np.int64)
    return np.unique(np.concatenate([np.array(t, dtype=np.int64) for t in tables]))


def owners_recounted(snapshot: CacheSnapshot) -> np.ndarray:
    """int32 [num_blocks]: the arrival index of each block's earliest-arriving holder, -1 where none holds it.
    The definition the aggregates keep, recounted from every table (for a first frame and for the tests)."""
    none = np.iinfo(np.int32).max
    owner = np.full(snapshot.num_blocks, none, dtype=np.int32)
    for view in snapshot.requests:
        blocks = held_blocks(view.block_tables)
        if blocks.size:
            np.minimum.at(owner, blocks, view.arrival_index)
    owner[owner == none] = -1
    return owner


class MapAggregates:
    """Per-block copies (state, ref count, fill, kind, owner) and per-cell counts for ``blocks_per_cell``-block
    cells. ``update`` brings them to a snapshot; the arrays are padded to whole cells with free blocks."""

    def __init__(self, num_blocks: int, blocks_per_cell: int) -> None:
        self.num_blocks = num_blocks
        self.blocks_per_cell = blocks_per_cell
        self.num_cells = -(-num_blocks // blocks_per_cell)
        padded = self.num_cells * blocks_per_cell
        self.state = np.full(padded, BLOCK_FREE, dtype=np.int8)
        self.refs = np.zeros(padded, dtype=np.int32)
        self.fill = np.zeros(padded, dtype=np.int16)
        self.kind = np.zeros(padded, dtype=np.int8)
        self.owner = np.full(padded, -1, dtype=np.int32)
        self.counts = np.zeros((self.num_cells, NUM_KINDS), dtype=np.int32)   # blocks of each kind per cell
        self.counts[:, KIND_FREE] = blocks_per_cell
        self.first_used = np.full(self.num_cells, blocks_per_cell, dtype=np.int32)
        self.used_tokens = 0    # the fill of the blocks in use, kept with the counts (the paged-vs-contiguous panel)
        self.applied: BlockArrays | None = None
        # Holders of a block besides its owner (only shared blocks have any), and which blocks have some.
        self._other_holders: dict[int, set[int]] = {}
        self._has_others = np.zeros(padded, dtype=bool)
        # id -> (arrival, tables, the blocks held: built when first needed, as most requests only grow a table)
        self._tables: dict[str, tuple[int, tuple, np.ndarray | None]] = {}
        # With KV-cache groups: each group's kind, each block's kind (from the last tables that held it), the kind
        # each held block is counted under (-1: not held), and per cell the held blocks of each kind.
        self.group_kinds: tuple[int, ...] = ()
        self.num_kinds = 0
        self.block_kind = np.zeros(0, dtype=np.int8)
        self.counted_kind = np.zeros(0, dtype=np.int8)
        self.kind_counts = np.zeros((self.num_cells, 0), dtype=np.int32)

    # --- bringing it up to date -------------------------------------------------------------------

    def update(self, snapshot: CacheSnapshot, versions: list[BlockArrays] = ()) -> None:
        """Bring everything to ``snapshot``. ``versions``: the block arrays of the steps since the last update,
        oldest first (the live window keeps them); without them, only the step right after still applies its
        changes, and anything further reads the whole arrays."""
        self._update_blocks(snapshot.blocks, versions)
        self._follow_groups(snapshot)
        self._update_owners(snapshot.requests)

    def _update_blocks(self, blocks: BlockArrays, versions) -> None:
        if blocks is self.applied:
            return
        chain = self._chain_to(blocks, versions)
        if chain is None:
            self._resync(blocks.arrays())
        elif chain:
            # Every version's changes at once (a slow frame follows hundreds of steps): a block changed twice
            # keeps its newest values, from its last place in the versions' order.
            every = np.concatenate([v.changes.indices for v in chain])
            indices, from_the_end = np.unique(every[::-1], return_index=True)    # sorted; first places, reversed
            newest = every.size - 1 - from_the_end
            old = self.kind[indices]
            self.used_tokens -= _fill_in_use(self.fill[indices], old)
            for which, array in enumerate((self.state, self.refs, self.fill)):
                array[indices] = np.concatenate([v.changes.values[which] for v in chain])[newest]
            self._recount(indices, old)
            self.used_tokens += _fill_in_use(self.fill[indices], self.kind[indices])
        self.applied = blocks

    def _chain_to(self, blocks: BlockArrays, versions) -> list[BlockArrays] | None:
        """The versions from the one applied to ``blocks``, each the change on the one before; None: no chain."""
        applied = self.applied
        if applied is None or applied.version is None or blocks.version is None:
            return None
        publisher, number = applied.version
        if blocks.version[0] != publisher or blocks.version[1] <= number:
            return None
        candidates = [v for v in versions if v.version is not None and v.version[0] == publisher
                      and number < v.version[1] < blocks.version[1]]
        chain = sorted({v.version[1]: v for v in candidates}.values(), key=lambda v: v.version[1]) + [blocks]
        if any(v.changes is None or v.version[1] != number + i for i, v in enumerate(chain, start=1)):
            return None
        return chain

    def _resync(self, arrays) -> None:
        """Everything from the whole arrays: O(blocks), for a broken chain only."""
        n = self.num_blocks
        state, refs, fill, _ = arrays
        self.state[:n], self.refs[:n], self.fill[:n] = state, refs, fill
        self.kind = kinds_of(self.state, self.refs)
        rows = self.kind.reshape(self.num_cells, self.blocks_per_cell)
        self.counts = np.stack([(rows == kind).sum(axis=1) for kind in range(NUM_KINDS)], axis=1).astype(np.int32)
        self.first_used = first_in_use(rows, self.blocks_per_cell)
        self.used_tokens = _fill_in_use(self.fill, self.kind)

    def _recount(self, indices: np.ndarray, old: np.ndarray) -> None:
        """The counts after the blocks at ``indices`` (unique, sorted) changed from kinds ``old``."""
        new = kinds_of(self.state[indices], self.refs[indices])
        self.kind[indices] = new
        width = self.blocks_per_cell
        cells = indices // width
        slots = self.num_cells * NUM_KINDS      # (cell, kind) pairs, counted in one pass each way
        moved = np.bincount(cells * NUM_KINDS + new, minlength=slots) - np.bincount(cells * NUM_KINDS + old,
                                                                                    minlength=slots)
        self.counts += moved.reshape(self.num_cells, NUM_KINDS).astype(np.int32)
        offsets = (indices - cells * width).astype(np.int32)
        used = new >= KIND_USED
        # ``indices`` are sorted, so a cell's first entry in use is its lowest offset that became in use.
        used_cells, used_offsets = cells[used], offsets[used]
        firsts = np.flatnonzero(np.concatenate(([True], used_cells[1:] != used_cells[:-1]))) if used_cells.size \
            else np.zeros(0, dtype=np.int64)
        heads = used_cells[firsts]
        self.first_used[heads] = np.minimum(self.first_used[heads], used_offsets[firsts])
        # A cell whose first block in use was freed looks again for its first (rare: new blocks land anywhere).
        lost = np.unique(cells[~used & (offsets == self.first_used[cells])])
        if lost.size:
            rows = self.kind.reshape(self.num_cells, width)[lost]
            self.first_used[lost] = first_in_use(rows, width)

    def _follow_groups(self, snapshot: CacheSnapshot) -> None:
        """Start counting kinds for the snapshot's groups; another engine's groups start the owners over too,
        so every request's blocks are taken again under their kind (once, O(blocks))."""
        kinds = kind_of_group(snapshot.kv_cache_groups)
        if kinds == self.group_kinds:
            return
        padded = self.num_cells * self.blocks_per_cell
        self.group_kinds, self.num_kinds = kinds, len(attention_kinds(snapshot.kv_cache_groups))
        self.block_kind = np.zeros(padded, dtype=np.int8)
        self.counted_kind = np.full(padded, -1, dtype=np.int8)
        self.kind_counts = np.zeros((self.num_cells, self.num_kinds), dtype=np.int32)
        self.owner[:] = -1
        self._other_holders.clear()
        self._has_others[:] = False
        self._tables = {}

    def _update_owners(self, requests: tuple[RequestView, ...]) -> None:
        """Each request's tables against the last frame's: what it gained and lost changes who holds what. All
        that was lost is let go first, then all that was gained is taken, each in one pass over the pool."""
        tables = self._tables
        now: dict[str, tuple[int, tuple, np.ndarray | None]] = {}
        gained, lost = _Changes(), _Changes()
        retagged: list[np.ndarray] = []
        for view in requests:
            request_id = view.request_id
            before = tables.pop(request_id, None)
            if before is not None and before[0] == view.arrival_index and _same_tables(before[1], view.block_tables):
                now[request_id] = before
                continue
            now[request_id] = (view.arrival_index, view.block_tables, None)
            if self.group_kinds:
                retagged.extend(self._take_kinds(view))
            if before is None or before[0] != view.arrival_index:
                if before is not None:
                    lost.add(_held(*before[1:]), before[0])
                gained.add(held_blocks(view.block_tables), view.arrival_index)
                continue
            more, fewer = _difference(before, view.block_tables)
            lost.add(fewer, view.arrival_index)
            gained.add(more, view.arrival_index)
        for arrival, old_tables, held in tables.values():     # requests that left the snapshot
            lost.add(_held(old_tables, held), arrival)
        self._tables = now
        lost_blocks, gained_blocks = lost.arrays(), gained.arrays()
        self._drop(*lost_blocks)
        self._hold(*gained_blocks)
        if self.group_kinds:
            self._count_kinds(np.unique(np.concatenate([lost_blocks[0], gained_blocks[0], *retagged])))

    def _take_kinds(self, view: RequestView) -> list[np.ndarray]:
        """Each block in a changed request's group tables is of its group's kind (O(the request's blocks)); the
        blocks whose kind this changed (a block a window let go of may come back to the same request in another
        group between two frames, held all along as the map sees it)."""
        retagged = []
        for tables in view.group_block_tables:
            for group, table in enumerate(tables):
                blocks = np.fromiter(table, dtype=np.int64, count=len(table))
                blocks = blocks[blocks != NULL_BLOCK]
                kind = self.group_kinds[group]
                retagged.append(blocks[self.block_kind[blocks] != kind])
                self.block_kind[blocks] = kind
        return retagged

    def _count_kinds(self, blocks: np.ndarray) -> None:
        """Recount the blocks whose holders changed: a block counts under its kind while anyone holds it."""
        after = np.where(self.owner[blocks] >= 0, self.block_kind[blocks], -1).astype(np.int8)
        before = self.counted_kind[blocks]
        cells = blocks // self.blocks_per_cell
        was, now = before >= 0, after >= 0
        np.subtract.at(self.kind_counts, (cells[was], before[was]), 1)
        np.add.at(self.kind_counts, (cells[now], after[now]), 1)
        self.counted_kind[blocks] = after

    def _hold(self, blocks: np.ndarray, arrivals: np.ndarray) -> None:
        if not blocks.size:
            return
        owner = self.owner[blocks]
        # In one pass: blocks nobody held, gained by one request only; the rest one by one.
        simple = (owner < 0) & _once(blocks)
        self.owner[blocks[simple]] = arrivals[simple]
        for block, arrival in zip(blocks[~simple].tolist(), arrivals[~simple].tolist(), strict=True):
            current = int(self.owner[block])
            if current < 0:
                self.owner[block] = arrival
                continue
            others = self._other_holders.setdefault(block, set())
            self._has_others[block] = True
            if arrival < current:
                self.owner[block] = arrival
                others.add(current)
            else:
                others.add(arrival)

    def _drop(self, blocks: np.ndarray, arrivals: np.ndarray) -> None:
        if not blocks.size:
            return
        shared = self._has_others[blocks]    # a block two requests let go of had two holders: shared
        alone, alone_arrivals = blocks[~shared], arrivals[~shared]
        self.owner[alone[self.owner[alone] == alone_arrivals]] = -1
        for block, arrival in zip(blocks[shared].tolist(), arrivals[shared].tolist(), strict=True):
            others = self._other_holders.get(block)
            if others is None:      # its other holders left earlier in this pass: it was held by this one alone
                if self.owner[block] == arrival:
                    self.owner[block] = -1
                continue
            if self.owner[block] == arrival:
                self.owner[block] = earliest = min(others)
                others.discard(earliest)
            else:
                others.discard(arrival)
            if not others:
                del self._other_holders[block]
                self._has_others[block] = False

    # --- reading ------------------------------------------------------------------------------

    def cell_kinds(self) -> np.ndarray:
        """The most important kind of block in each cell."""
        counts = self.counts
        kinds = np.full(self.num_cells, KIND_FREE, dtype=np.int8)
        for kind in (KIND_CACHED, KIND_USED, KIND_SHARED):
            kinds[counts[:, kind] > 0] = kind
        return kinds

    def cell_owners(self) -> np.ndarray:
        """The owner of each cell's first block in use (-1 where none is in use)."""
        width = self.blocks_per_cell
        first = np.minimum(self.first_used, width - 1)
        owners = self.owner[np.arange(self.num_cells) * width + first]
        return np.where(self.first_used < width, owners, -1)

    def cells_of_kind(self, kind: int) -> np.ndarray:
        """The cells holding blocks of this attention kind: O(cells)."""
        return np.flatnonzero(self.kind_counts[:, kind])

    def cells_in_use(self) -> np.ndarray:
        return self.counts[:, KIND_USED] + self.counts[:, KIND_SHARED]

    def used_blocks(self) -> int:
        """Blocks in use in the whole pool: O(cells)."""
        return int(self.counts[:, KIND_USED].sum(dtype=np.int64) + self.counts[:, KIND_SHARED].sum(dtype=np.int64))


class _Changes:
    """Blocks gained (or lost) by the requests of one frame, gathered for one pass over the pool."""

    def __init__(self) -> None:
        self._parts: list = []
        self._arrivals: list[int] = []
        self._counts: list[int] = []

    def add(self, blocks, arrival: int) -> None:
        if len(blocks):
            self._parts.append(blocks)
            self._arrivals.append(arrival)
            self._counts.append(len(blocks))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, the arrival index of the request for each)."""
        total = sum(self._counts)
        blocks = np.fromiter(itertools.chain.from_iterable(self._parts), dtype=np.int64, count=total)
        return blocks, np.repeat(np.array(self._arrivals, dtype=np.int32), self._counts)


def _fill_in_use(fill: np.ndarray, kinds: np.ndarray) -> int:
    """The tokens in the blocks of ``kinds`` in use."""
    return int(fill[kinds >= KIND_USED].sum(dtype=np.int64))


def _once(blocks: np.ndarray) -> np.ndarray:
    """Which entries of ``blocks`` name a block no other entry names."""
    order = np.argsort(blocks, kind="stable")
    ordered = blocks[order]
    repeated = np.zeros(blocks.size, dtype=bool)
    same = ordered[1:] == ordered[:-1]
    repeated[1:] |= same
    repeated[:-1] |= same
    once = np.empty(blocks.size, dtype=bool)
    once[order] = ~repeated
    return once


def _same_tables(before: tuple, after: tuple) -> bool:
    """Whether two views' tables are the very same tuples (the engine builds a new tuple for every change)."""
    return before is after or (len(before) == len(after) and all(a is b for a, b in zip(before, after,
                                                                                           strict=True)))


def _held(block_tables: tuple, held: np.ndarray | None) -> np.ndarray:
    return held_blocks(block_tables) if held is None else held


def _difference(before: tuple[int, tuple, np.ndarray | None], after: tuple) -> tuple:
    """(blocks gained, blocks lost) between a request's tables at the last frame and now."""
    old_tables = before[1]
    if len(old_tables) == 1 and len(after) == 1:
        old, new = old_tables[0], after[0]
        if len(new) >= len(old) and new[:len(old)] == old:    # decoding: blocks added at the end
            return new[len(old):], ()
    held, old_held = held_blocks(after), _held(old_tables, before[2])
    return np.setdiff1d(held, old_held, assume_unique=True), np.setdiff1d(old_held, held, assume_unique=True)
