"""One vLLM device pool (one data-parallel rank) as its KV-cache events describe it.

The events name blocks by content hash, never by physical block id, so the map
cannot show where a block really lives. Instead each announced block gets a
stable slot of its own, in order of arrival (the lowest slot free when it came),
and keeps it until vLLM says it was evicted. That is what the map draws.

A block's parent hash chains it to the block before it in the same sequence, so
announced blocks form prefix trees: a block whose parent is unknown (no parent,
or a parent evicted or announced before kvscope attached) starts a tree of its
own. Per slot the model keeps its tree, depth and live children in numpy arrays,
so a snapshot of a pool of a million blocks is a few array copies; per tree it
keeps a handful of numbers and the first tokens of its root, for the preview.
Everything here is bounded by the pool size, whatever the number of events.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

import numpy as np

from kvscope.app.attach.events import CLEARED, REMOVED, STORED, on_device

MASK64 = (1 << 64) - 1
PREVIEW_TOKENS = 48     # tokens kept from a tree's root block(s) for the prefix panel
JOURNAL_SLOTS = 4096    # slots named per take_journal() (the counts are always whole)


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

    __slots__ = ("num_blocks", "num_reuses", "preview", "partial")

    def __init__(self, preview: array, partial: bool) -> None:
        self.num_blocks = 0
        # Store events that show a request reusing the tree: blocks announced again (vLLM re-announces
        # the blocks a request hit in some paths) or a new branch under a block that already had one.
        self.num_reuses = 0
        self.preview = preview      # token ids from the root block on (at most PREVIEW_TOKENS)
        self.partial = partial      # its root's parent was announced but is not known here


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
        self.hash_at = np.zeros(num_blocks, dtype=np.uint64)
        self.tree_at = np.full(num_blocks, -1, dtype=np.int32)
        self.depth_at = np.zeros(num_blocks, dtype=np.int32)
        self.children_at = np.zeros(num_blocks, dtype=np.int32)
        self.parent_at = np.full(num_blocks, -1, dtype=np.int32)
        # A slot's generation tells a child whether its parent slot still holds its parent.
        self.generation_at = np.zeros(num_blocks, dtype=np.int32)
        self.parent_generation_at = np.zeros(num_blocks, dtype=np.int32)
        self.trees: dict[int, TreeStats] = {}
        self.dirty_trees: set[int] = set()
        self.version = 0
        self._free_slots: list[int] = []
        self._high_water = 0
        self._next_tree = 0
        self._counts = dict.fromkeys(PoolCounters.__dataclass_fields__, 0)
        self._journal: tuple[list[int], list[int], list[int]] = ([], [], [0, 0, 0])

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
            if isinstance(event, STORED):
                if on_device(event):
                    self.store(event.block_hashes, event.parent_block_hash, event.token_ids)
                else:
                    self._counts["num_other_media"] += 1
            elif isinstance(event, REMOVED):
                if on_device(event):
                    self.remove(event.block_hashes)
                else:
                    self._counts["num_other_media"] += 1
            elif isinstance(event, CLEARED):
                self.clear()
                self._counts["num_cleared"] += 1

    def store(self, block_hashes, parent_hash, token_ids) -> None:
        size = self.block_size
        reused = None   # the tree this event shows a request reusing, if any
        for index, block_hash in enumerate(block_hashes):
            slot = self.slot_of.get(block_hash)
            if slot is not None:
                self._counts["num_duplicates"] += 1
                reused = int(self.tree_at[slot]) if reused is None else reused
            else:
                forked = self._store_one(block_hash, parent_hash, token_ids[index * size:(index + 1) * size])
                reused = forked if reused is None else reused
            parent_hash = block_hash
        if reused is not None:
            self.trees[reused].num_reuses += 1
            self.dirty_trees.add(reused)
        self._counts["num_stored"] += len(block_hashes)
        self.version += 1

    def _store_one(self, block_hash, parent_hash, tokens) -> int | None:
        """Give the block a slot; the tree it branched off, when it started a new branch of one."""
        slot = self._take_slot()
        if slot is None:
            self._counts["num_overflow"] += 1
            return None
        parent = self.slot_of.get(parent_hash) if parent_hash is not None else None
        forked = None
        if parent is None:
            tree = self._new_tree(tokens, partial=parent_hash is not None)
            depth = 0
        else:
            tree, depth = int(self.tree_at[parent]), int(self.depth_at[parent]) + 1
            forked = tree if self.children_at[parent] else None
            self._adopt(parent, tree, depth, tokens)
        self.slot_of[block_hash] = slot
        self.hash_at[slot] = hash_key(block_hash)
        self.tree_at[slot] = tree
        self.depth_at[slot] = depth
        self.parent_at[slot] = -1 if parent is None else parent
        self.parent_generation_at[slot] = 0 if parent is None else self.generation_at[parent]
        self.trees[tree].num_blocks += 1
        self.dirty_trees.add(tree)
        self._note(0, slot)
        return forked

    def _adopt(self, parent: int, tree: int, depth: int, tokens) -> None:
        stats = self.trees[tree]
        self.children_at[parent] += 1
        # The preview follows the tree's first path only: this block must start where it stops.
        if len(stats.preview) == depth * self.block_size < PREVIEW_TOKENS:
            stats.preview.extend(tokens[:PREVIEW_TOKENS - len(stats.preview)])

    def _new_tree(self, tokens, partial: bool) -> int:
        tree = self._next_tree
        self._next_tree += 1
        self.trees[tree] = TreeStats(array("l", tokens[:PREVIEW_TOKENS]), partial)
        return tree

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        if self._high_water < self.num_blocks:
            self._high_water += 1
            return self._high_water - 1
        return None

    def remove(self, block_hashes) -> None:
        for block_hash in block_hashes:
            slot = self.slot_of.pop(block_hash, None)
            if slot is None:
                self._counts["num_unknown_removed"] += 1
            else:
                self._release(slot)
                self._counts["num_removed"] += 1
        self.version += 1

    def _release(self, slot: int) -> None:
        parent = int(self.parent_at[slot])
        if parent >= 0 and self.generation_at[parent] == self.parent_generation_at[slot]:
            self.children_at[parent] -= 1
        tree = int(self.tree_at[slot])
        stats = self.trees[tree]
        stats.num_blocks -= 1
        if stats.num_blocks == 0:
            del self.trees[tree]
        self.dirty_trees.add(tree)
        self.hash_at[slot] = 0
        self.tree_at[slot] = -1
        self.children_at[slot] = 0
        self.parent_at[slot] = -1
        self.generation_at[slot] += 1
        heapq.heappush(self._free_slots, slot)
        self._note(1, slot)

    def clear(self) -> None:
        """Forget every block (AllBlocksCleared, or the server restarted). Counters are kept."""
        used = self._high_water
        self.dirty_trees.update(self.trees)
        self.slot_of.clear()
        self.trees.clear()
        self._free_slots.clear()
        self._high_water = 0
        self.hash_at[:used] = 0
        self.tree_at[:used] = -1
        self.depth_at[:used] = 0
        self.children_at[:used] = 0
        self.parent_at[:used] = -1
        self.generation_at[:used] += 1
        self._journal[2][2] += 1
        self.version += 1
