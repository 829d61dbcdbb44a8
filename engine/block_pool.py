"""Physical KV blocks: reference counts, the free queue and the prefix-cache map.

Per-block state lives in numpy arrays so a snapshot is four array copies.

Every change to the prefix-cache map is queued as a KV-cache event (BlockStored, BlockRemoved,
AllBlocksCleared) until take_events() hands the queue over, as vLLM's BlockPool hands out its
kv_event_queue; the KV cache manager queues its copy-on-writes there too.

The free queue is ordered by eviction priority. Blocks that hold nothing worth
keeping sit at the front; a freed block that still holds a cached prefix goes to
the back, so cached blocks are evicted least recently used first, and only
once no plain free block is left.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

from kvscope.engine.outputs import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_USED,
    NULL_BLOCK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)

_NO_EVENTS = ()
# NULL_BLOCK (defined with the snapshot, which carries it): a block-table entry that holds no block. A
# sliding-window group's table keeps its length as the request advances, and the entries of blocks that left the
# window (and went back to the pool) hold it. No pool method takes it; the attention kernels never read such an
# entry (the model runner still hands them a real block id in its place, so no kernel ever indexes the pool with
# it).
__all__ = ["NULL_BLOCK", "BlockPool"]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.fill = np.zeros(num_blocks, dtype=np.int16)
        self.hashes = np.zeros(num_blocks, dtype=np.uint64)
        self.state = np.zeros(num_blocks, dtype=np.int8)
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}     # prefix hash -> block holding it
        self.num_cached_free_blocks = 0
        self.num_evicted_blocks = 0     # cumulative: cached prefixes dropped to make room
        self.kv_event_queue: list = []  # since the last take_events(), oldest first
        # Blocks whose arrays changed since the last take_changes(); None: every block may have.
        self.changed: list[int] | None = []
        # With KV-cache groups (track_groups): the group each block was last taken for, and the blocks in use per
        # group, kept as references come and go so a step's counters cost nothing per block. None: one group.
        self.block_group: np.ndarray | None = None
        self.group_held: list[int] | None = None

    def track_groups(self, num_groups: int) -> None:
        """Count the blocks in use per KV-cache group from now on (a new pool: every block is free)."""
        self.block_group = np.zeros(self.num_blocks, dtype=np.int8)
        self.group_held = [0] * num_groups

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated, cached-free ones included."""
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_queue)

    def allocate(self, count: int, group: int = 0) -> list[int]:
        """Take ``count`` blocks from the front of the free queue for a table of KV-cache group ``group``. The
        caller checked there are enough."""
        if count > len(self.free_block_queue):
            raise RuntimeError(f"allocate({count}) with only {len(self.free_block_queue)} free blocks")
        queue = self.free_block_queue
        blocks = [queue.popitem(last=False)[0] for _ in range(count)]
        for block in blocks:
            if self.hashes[block]:
                self._evict(block)
            self.fill[block] = 0
        self.ref_counts[blocks] = 1
        self.state[blocks] = BLOCK_USED
        self.mark(blocks)
        if self.group_held is not None:
            self.block_group[blocks] = group
            self.group_held[group] += count
        return blocks

    def assign_group(self, blocks, group: int) -> None:
        """Blocks in use that allocate() took for group 0 serve ``group`` instead (a swap-in takes every
        group's blocks at once)."""
        if self.group_held is None:
            return
        for block in blocks:
            self.group_held[self.block_group[block]] -= 1
            self.block_group[block] = group
            self.group_held[group] += 1

    def _evict(self, block: int) -> None:
        block_hash = int(self.hashes[block])
        del self.cached_blocks[block_hash]
        self.hashes[block] = 0
        self.num_cached_free_blocks -= 1
        self.kv_event_queue.append(BlockRemoved(block_hash, block))
        self.num_evicted_blocks += 1

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on blocks found in the prefix cache, pulling free ones out of the free queue."""
        self.mark(blocks)
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_block_queue[block]
                self.num_cached_free_blocks -= 1
                self.state[block] = BLOCK_USED
                if self.group_held is not None:     # a cached block keeps the group it was cached for
                    self.group_held[self.block_group[block]] += 1
            self.ref_counts[block] += 1

    def incref(self, blocks: list[int]) -> None:
        """Add a reference to blocks that are already in use (sharing between samples)."""
        self.mark(blocks)
        for block in blocks:
            self.ref_counts[block] += 1

    def free(self, blocks) -> None:
        """Drop one reference from each block, in the order given (callers pass tails first)."""
        queue, changed = self.free_block_queue, self.changed
        for block in blocks:
            if changed is not None:
                changed.append(block)
            count = self.ref_counts[block] - 1
            self.ref_counts[block] = count
            if count:
                continue
            if self.group_held is not None:
                self.group_held[self.block_group[block]] -= 1
            queue[block] = None
            if self.hashes[block]:
                self.state[block] = BLOCK_CACHED
                self.num_cached_free_blocks += 1
            else:
                queue.move_to_end(block, last=False)
                self.state[block] = BLOCK_FREE
                self.fill[block] = 0

    def lookup(self, block_hash: int) -> int | None:
        return self.cached_blocks.get(block_hash)

    def register(self, block: int, block_hash: int, parent_hash: int | None, token_ids) -> None:
        """Record that a full, computed, in-use block holds the prefix with this hash: ``token_ids`` after
        the chain ending in ``parent_hash`` (None for a first block)."""
        if block_hash in self.cached_blocks or self.hashes[block]:
            return  # the same prefix already has a block, or this block is registered
        self.cached_blocks[block_hash] = block
        self.hashes[block] = block_hash
        self.mark((block,))
        self.kv_event_queue.append(BlockStored(block_hash, parent_hash, tuple(token_ids), self.block_size, block))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix, as vLLM's does: only while no block is in use (False, changing nothing,
        otherwise), so no running request holds a block the cache no longer knows."""
        if self.num_used_blocks:
            return False
        if self.cached_blocks:
            self.cached_blocks = {}
            self.hashes[:] = 0
            self.state[:] = BLOCK_FREE
            self.fill[:] = 0
            self.num_cached_free_blocks = 0
            self.changed = None
        self.kv_event_queue.append(AllBlocksCleared())
        return True

    def mark(self, blocks) -> None:
        """Record that ``blocks``' arrays changed (anyone writing to them directly calls this)."""
        changed = self.changed
        if changed is not None:
            changed.extend(blocks)
            if len(changed) > 4 * self.num_blocks + 4096:   # untaken for long: "all" is cheaper to keep
                self.changed = None

    def mark_one(self, block: int) -> None:
        """mark((block,)) for one block: a decode's, every request every step. The size check is mark's: it runs
        whenever a block is allocated, so the list never outgrows it by more than a few blocks a sequence."""
        changed = self.changed
        if changed is not None:
            changed.append(block)

    def take_changes(self) -> np.ndarray | None:
        """The sorted distinct blocks changed since the last call, or None if every block may have."""
        changed = self.peek_changes()
        self.changed = []
        return changed

    def peek_changes(self) -> np.ndarray | None:
        """take_changes() without taking: the blocks stay recorded."""
        if self.changed is None:
            return None
        # Sorted, then each block once: np.unique does the same through a hash table, about four times slower for
        # the few hundred blocks of a decode step.
        blocks = np.asarray(self.changed, dtype=np.int64)
        blocks.sort()
        return blocks[np.concatenate(([True], blocks[1:] != blocks[:-1]))] if len(blocks) > 1 else blocks

    def take_events(self) -> list:
        """The queued events, oldest first, leaving the queue empty; an empty tuple when there are none."""
        events = self.kv_event_queue
        if not events:
            return _NO_EVENTS
        self.kv_event_queue = []
        return events

    def rebuild(self, tables, forget) -> None:
        """Make the pool agree with ``tables`` (the block tables still in use) after a step failed part-way.

        Reference counts are recounted and the free queue, states and prefix map rebuilt from them, so the
        result is right wherever the step stopped. A block in ``forget`` that nobody holds any more loses its
        prefix hash: the failed step may have left it half written. Blocks that were free keep their place
        in the free queue; newly freed ones join it as free() would put them.
        """
        self.changed = None
        entries = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64)
        self.ref_counts[:] = np.bincount(entries, minlength=self.num_blocks)
        unreferenced = self.ref_counts == 0
        for block in forget:
            if unreferenced[block] and self.hashes[block]:
                self.kv_event_queue.append(BlockRemoved(int(self.hashes[block]), block))
                self.hashes[block] = 0
        hashed = self.hashes != 0
        self.cached_blocks = {int(self.hashes[block]): int(block) for block in np.flatnonzero(hashed)}
        self.state[:] = BLOCK_USED
        self.state[unreferenced & hashed] = BLOCK_CACHED
        self.state[unreferenced & ~hashed] = BLOCK_FREE
        self.fill[unreferenced & ~hashed] = 0
        was_free = [block for block in self.free_block_queue if unreferenced[block]]
        newly_free = sorted(set(np.flatnonzero(unreferenced).tolist()) - set(was_free))
        order = newly_free + was_free
        self.free_block_queue = OrderedDict.fromkeys([b for b in order if not hashed[b]] +
                                                     [b for b in order if hashed[b]])
        self.num_cached_free_blocks = int((unreferenced & hashed).sum())
        if self.group_held is not None:
            held = np.bincount(self.block_group[~unreferenced], minlength=len(self.group_held))
            self.group_held = held.tolist()
