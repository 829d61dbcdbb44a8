"""One vLLM device pool (one data-parallel rank) as its KV-cache events describe it.

The events name blocks by content hash, never by physical block id, so the map
cannot show where a block really lives. Instead each announced block gets a
stable slot of its own, in order of arrival (the lowest slot free when it came),
and keeps it until vLLM says it was evicted. That is what the map draws.

A block's parent hash chains it to the block before it in the same sequence, so
announced blocks form prefix trees: a block whose parent is unknown (no parent,
or a parent evicted or announced before kvscope attached) starts a tree of its
own. Per slot the model keeps its tree, depth and live children in flat
``array.array`` columns: the event path reads and writes single items, which
these do several times faster than numpy, and the snapshot builder reads them
through zero-copy numpy views (``tree_at`` and the like), so a snapshot of a
pool of a million blocks is a few array copies. Per tree it keeps a handful of
numbers and the first tokens of its root, for the preview. Token ids arrive
still encoded and are decoded only for those. Everything here is bounded by the
pool size, whatever the number of events.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

import msgspec
import numpy as np

from kvscope.app.attach.feed.events import CLEARED, DEVICE_MEDIA, REMOVED, STORED
from kvscope.app.attach.feed.groups import GroupTally, block_key, group_of

MASK64 = (1 << 64) - 1
PREVIEW_TOKENS = 48     # tokens kept from a tree's root block(s) for the prefix panel
JOURNAL_SLOTS = 4096    # slots named per take_journal() (the counts are always whole)
MAX_DIRTY_TREES = 4096


@dataclass(frozen=True)
class PoolCounters:
    """What happened to the pool since kvscope attached, and what did not add up."""

    num_stored: int = 0             # blocks announced (BlockStored hashes)
    num_removed: int = 0            # blocks evicted (BlockRemoved hashes that were known)
    num_cleared: int = 0            # AllBlocksCleared events
    num_unknown_removed: int = 0    # evictions of blocks kvscope never saw stored
    num_duplicates: int = 0         # stores of a hash already known: vLLM announcing a block again
    num_overflow: int = 0           # stores that found every slot taken (removals were missed)
    num_other_media: int = 0        # events about a CPU or storage tier, not the device pool


@dataclass(frozen=True)
class Journal:
    """What changed since the previous take: the run log's events for one step."""

    stored_slots: tuple[int, ...]       # at most JOURNAL_SLOTS of them
    removed_slots: tuple[int, ...]
    num_stored: int
    num_removed: int
    num_cleared: int

    @property
    def empty(self) -> bool:
        return not (self.num_stored or self.num_removed or self.num_cleared)


class TreeStats:
    """One prefix tree's running figures. Mutable; lives only inside PoolModel."""

    __slots__ = ("num_blocks", "num_reuses", "preview", "partial", "row")

    def __init__(self, preview: array, partial: bool, row: int) -> None:
        self.row = row              # its row in the pool's tree table (tree_row_sizes)
        self.num_blocks = 0
        # Store events that show a request reusing the tree: blocks announced again (vLLM re-announces
        # the blocks a request hit in some paths) or a new branch under a block that already had one.
        self.num_reuses = 0
        self.preview = preview      # token ids from the root block on (at most PREVIEW_TOKENS)
        self.partial = partial      # its root's parent was announced but is not known here


def _column(typecode: str, size: int, fill: int) -> array:
    return array(typecode, [fill]) * size


def hash_key(block_hash: int | bytes) -> int:
    """The 64-bit value the snapshot shows for a hash (0 means "no hash", so never 0)."""
    if isinstance(block_hash, bytes):
        value = int.from_bytes(block_hash[-8:], "big")
    else:
        value = block_hash & MASK64
    return value or 1


class PoolModel:
    """Applies decoded events; ``counters``, the arrays and ``trees`` are read by the snapshot builder."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks and a block size, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slot_of: dict[int | bytes, int] = {}
        size = num_blocks
        self._hash, self._tree = _column("Q", size, 0), _column("i", size, -1)
        self._depth, self._children = _column("i", size, 0), _column("i", size, 0)
        self._parent = _column("i", size, -1)
        # A slot's generation tells a child whether its parent slot still holds its parent.
        self._generation, self._parent_generation = _column("i", size, 0), _column("i", size, 0)
        # Zero-copy numpy views of the columns, for snapshots and checks (never resized, so always valid).
        self.hash_at = np.frombuffer(self._hash, dtype=np.uint64)
        self.tree_at = np.frombuffer(self._tree, dtype=np.int32)
        self.depth_at = np.frombuffer(self._depth, dtype=np.int32)
        self.children_at = np.frombuffer(self._children, dtype=np.int32)
        self.parent_at = np.frombuffer(self._parent, dtype=np.int32)
        self.generation_at = np.frombuffer(self._generation, dtype=np.int32)
        self.parent_generation_at = np.frombuffer(self._parent_generation, dtype=np.int32)
        # A table of the live trees' sizes, a row each (a tree has a block, so rows never outnumber slots):
        # finding the largest of thousands of trees is then one numpy partition, not a pass over a dict.
        self._row_tree, self._row_size = _column("q", size, -1), _column("i", size, 0)
        self.tree_row_ids = np.frombuffer(self._row_tree, dtype=np.int64)
        self.tree_row_sizes = np.frombuffer(self._row_size, dtype=np.int32)
        self._free_rows: list[int] = []
        self.tree_rows_used = 0
        self.trees: dict[int, TreeStats] = {}
        # Trees changed since the snapshot builder last looked. Past MAX_DIRTY_TREES the set is dropped
        # and ``all_dirty`` says to rebuild every tree instead, so it stays small even when nobody looks
        # (a bench, a window that stopped drawing) and a rebuild costs no more than the set would.
        self.dirty_trees: set[int] = set()
        self.all_dirty = False
        self.version = 0
        self._free_slots: list[int] = []
        self._high_water = 0
        self._next_tree = 0
        self._counts = dict.fromkeys(PoolCounters.__dataclass_fields__, 0)
        self._journal: tuple[list[int], list[int], list[int]] = ([], [], [0, 0, 0])
        self.groups = GroupTally(size)   # the KV-cache groups the events name, if they name any

    # --- reading ----------------------------------------------------------------------

    @property
    def num_known_blocks(self) -> int:
        return len(self.slot_of)

    @property
    def high_water(self) -> int:
        """Slots at and above this were never used since the last clear."""
        return self._high_water

    @property
    def counters(self) -> PoolCounters:
        return PoolCounters(**self._counts)

    def _touch(self, tree: int) -> None:
        if len(self.dirty_trees) >= MAX_DIRTY_TREES:
            self.dirty_trees.clear()
            self.all_dirty = True
        self.dirty_trees.add(tree)

    def take_journal(self) -> Journal:
        stored, removed, counts = self._journal
        self._journal = ([], [], [0, 0, 0])
        return Journal(tuple(stored), tuple(removed), *counts)

    def _note(self, which: int, slot: int) -> None:
        slots, counts = self._journal[which], self._journal[2]
        counts[which] += 1
        if len(slots) < JOURNAL_SLOTS:
            slots.append(slot)

    # --- applying events -----------------------------------------------------------------

    def apply(self, events) -> None:
        for event in events:
            kind = type(event)
            if kind in STORED:
                if event.medium in DEVICE_MEDIA:
                    group = group_of(event)
                    if group is not None:
                        self.groups.learn(event, group)
                    self.store(event.block_hashes, event.parent_block_hash, event.token_ids, group)
                else:
                    self._counts["num_other_media"] += 1
            elif kind in REMOVED:
                if event.medium in DEVICE_MEDIA:
                    self.remove(event.block_hashes, group_of(event))
                else:
                    self._counts["num_other_media"] += 1
            elif kind in CLEARED:
                self.clear()
                self._counts["num_cleared"] += 1

    def store(self, block_hashes, parent_hash, token_ids, group: int | None = None) -> None:
        """``token_ids``: a list, or still encoded (msgspec.Raw), decoded only if a preview needs it. ``group``:
        the KV-cache group the event names, whose blocks are kept apart from the other groups' (groups.py)."""
        size = self.block_size
        tokens = _TokenSlicer(token_ids, size)
        reused = None   # the tree this event shows a request reusing, if any
        slot_of = self.slot_of
        if group:
            block_hashes = [block_key(block_hash, group) for block_hash in block_hashes]
            parent_hash = block_key(parent_hash, group) if parent_hash is not None else None
        for index, block_hash in enumerate(block_hashes):
            slot = slot_of.get(block_hash)
            if slot is not None:
                self._counts["num_duplicates"] += 1
                reused = self._tree[slot] if reused is None else reused
            else:
                forked = self._store_one(block_hash, parent_hash, tokens, index, group)
                reused = forked if reused is None else reused
            parent_hash = block_hash
        if reused is not None:
            self.trees[reused].num_reuses += 1
            self._touch(reused)
        self._counts["num_stored"] += len(block_hashes)
        self.version += 1

    def _store_one(self, block_hash, parent_hash, tokens: _TokenSlicer, index: int,
                   group: int | None = None) -> int | None:
        """Give the block a slot; the tree it branched off, when it started a new branch of one."""
        slot = self._take_slot()
        if slot is None:
            self._counts["num_overflow"] += 1
            return None
        parent = self.slot_of.get(parent_hash) if parent_hash is not None else None
        forked = None
        if parent is None:
            tree = self._new_tree(tokens.block(index), partial=parent_hash is not None)
            depth = 0
            self._parent[slot] = -1
            self._parent_generation[slot] = 0
        else:
            tree, depth = self._tree[parent], self._depth[parent] + 1
            forked = tree if self._children[parent] else None
            self._adopt(parent, tree, depth, tokens, index)
            self._parent[slot] = parent
            self._parent_generation[slot] = self._generation[parent]
        self.slot_of[block_hash] = slot
        self._hash[slot] = hash_key(block_hash[1] if isinstance(block_hash, tuple) else block_hash)
        self.groups.stored(slot, group)
        self._tree[slot] = tree
        self._depth[slot] = depth
        stats = self.trees[tree]
        stats.num_blocks += 1
        self._row_size[stats.row] += 1
        self._touch(tree)
        self._note(0, slot)
        return forked

    def _adopt(self, parent: int, tree: int, depth: int, tokens: _TokenSlicer, index: int) -> None:
        stats = self.trees[tree]
        self._children[parent] += 1
        # The preview follows the tree's first path only: this block must start where it stops.
        if len(stats.preview) == depth * self.block_size < PREVIEW_TOKENS:
            stats.preview.extend(tokens.block(index)[:PREVIEW_TOKENS - len(stats.preview)])

    def _new_tree(self, tokens, partial: bool) -> int:
        tree = self._next_tree
        self._next_tree += 1
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row, self.tree_rows_used = self.tree_rows_used, self.tree_rows_used + 1
        self._row_tree[row] = tree
        self.trees[tree] = TreeStats(array("l", tokens[:PREVIEW_TOKENS]), partial, row)
        return tree

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        if self._high_water < self.num_blocks:
            self._high_water += 1
            return self._high_water - 1
        return None

    def remove(self, block_hashes, group: int | None = None) -> None:
        pop, removed = self.slot_of.pop, 0
        for block_hash in block_hashes:
            slot = pop(block_key(block_hash, group), None)
            if slot is not None:
                self._release(slot)
                removed += 1
        self._counts["num_removed"] += removed
        self._counts["num_unknown_removed"] += len(block_hashes) - removed
        self.version += 1

    def _release(self, slot: int) -> None:
        parent = self._parent[slot]
        if parent >= 0 and self._generation[parent] == self._parent_generation[slot]:
            self._children[parent] -= 1
        tree = self._tree[slot]
        stats = self.trees[tree]
        stats.num_blocks -= 1
        self._row_size[stats.row] -= 1
        if stats.num_blocks == 0:
            self._row_tree[stats.row] = -1
            self._free_rows.append(stats.row)
            del self.trees[tree]
        self._touch(tree)
        self._hash[slot] = 0
        self._tree[slot] = -1
        self.groups.released(slot)
        self._children[slot] = 0
        self._parent[slot] = -1
        self._generation[slot] += 1
        heapq.heappush(self._free_slots, slot)
        self._note(1, slot)

    def clear(self) -> None:
        """Forget every block (AllBlocksCleared, or the server restarted). Counters are kept."""
        used = self._high_water
        self.dirty_trees.clear()
        self.all_dirty = True
        self.slot_of.clear()
        self.trees.clear()
        self.tree_row_ids[:self.tree_rows_used] = -1
        self.tree_row_sizes[:self.tree_rows_used] = 0
        self._free_rows.clear()
        self.tree_rows_used = 0
        self._free_slots.clear()
        self._high_water = 0
        self.hash_at[:used] = 0
        self.tree_at[:used] = -1
        self.depth_at[:used] = 0
        self.children_at[:used] = 0
        self.parent_at[:used] = -1
        self.generation_at[:used] += 1
        self.groups.cleared(used)
        self._journal[2][2] += 1
        self.version += 1


class _TokenSlicer:
    """One store event's token ids, decoded from msgpack the first time a block's are asked for."""

    __slots__ = ("_raw", "_tokens", "_size")

    def __init__(self, token_ids, block_size: int) -> None:
        self._raw, self._size = token_ids, block_size
        self._tokens = None if isinstance(token_ids, msgspec.Raw) else token_ids

    def block(self, index: int) -> list[int]:
        if self._tokens is None:
            try:
                self._tokens = msgspec.msgpack.decode(self._raw, type=list[int])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._tokens = []   # a preview without text is all this costs
        return self._tokens[index * self._size:(index + 1) * self._size]
