"""Block tables on top of the block pool: prefix caching, copy-on-write, swap and the two allocators.

Every method that takes blocks is all-or-nothing: it first counts what it
needs, returns False if the pool is short, and only then changes anything.
It moves blocks, never a request's counters: as in vLLM, only the scheduler
advances num_computed_tokens, after the calls here say what they did.

The cache moves it decides (copy-on-write, swap out, swap in) are queued here
and drained into the next ScheduledBatch; the model runner performs them.
What it did that the scheduler reports (prefix-cache changes, copy-on-writes)
comes out of one call, take_events().
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvscope.engine.block_changes import BlockArrays, BlockPublisher
from kvscope.engine.block_pool import BlockPool
from kvscope.engine.config import max_request_tokens
from kvscope.engine.request import Request, Sequence

_HASH_MASK = (1 << 63) - 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: int, token_ids) -> int:
    """Chain hash of one full block: non-zero, deterministic (ints and tuples hash stably in CPython)."""
    return (hash((parent_hash, *token_ids)) & _HASH_MASK) or 1


def fill_blocks(pool: BlockPool, table: tuple[int, ...], old: int, new: int) -> None:
    """Record that ``table``'s slots for positions ``old .. new - 1`` now hold computed K/V."""
    bs, fill = pool.block_size, pool.fill
    if new - old == 1:  # a decode: one slot in one block
        block = table[old // bs]
        fill[block] = old % bs + 1
        pool.mark_one(block)
    else:
        for i in range(old // bs, cdiv(new, bs)):
            fill[table[i]] = min(bs, new - i * bs)
        pool.mark(table[old // bs:cdiv(new, bs)])


class KVCacheState(NamedTuple):
    """Both pools' state at one moment, for a snapshot and its stats: the device pool's per-block arrays as
    a published version (engine/block_changes.py: built whole only when asked), and plain counts."""

    blocks: BlockArrays                 # block_state, ref_counts, block_fill, block_hashes
    num_blocks: int
    live_fill: np.ndarray               # the pool's own fill array: read only while this state is current
    num_free_blocks: int                # cached-free ones included
    num_cached_free_blocks: int
    num_host_blocks: int
    num_free_host_blocks: int
    num_tokens_held: int                # slots holding computed K/V in blocks in use, shared blocks once
    prefix_cache_queries: int           # the rest are cumulative
    prefix_cache_hits: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_copy_on_write_blocks: int
    num_evicted_blocks: int
    # With KV-cache groups, per group: blocks in use, and blocks its sliding window let go of (cumulative, and
    # since the last published step). Empty with one group.
    group_held_blocks: tuple[int, ...] = ()
    window_freed_blocks: tuple[int, ...] = ()
    window_freed_step: tuple[int, ...] = ()


class CopyOnWrite(NamedTuple):
    """A sample was about to write into a block another sample shares, so it got a copy of it."""

    sample_index: int
    src: int
    dst: int


class KVCacheManager:
    groups: tuple = ()      # KV-cache groups kept apart (engine/kv_cache_groups.py); none: one, every layer full
    # Whether append_slot may have work for a token that is not a block's first (its table always has room
    # then). A sliding window frees blocks at any position, so the hybrid manager says True.
    slot_work_inside_blocks = False

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int, *,
                 enable_prefix_caching: bool = True, allocator: str = "paged", max_model_len: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks, block_size)
        self.host_pool = BlockPool(num_host_blocks, block_size)
        self.publisher = BlockPublisher()
        self.contiguous = allocator == "contiguous"
        # The contiguous baseline predates paging: no sharing, so no prefix cache and no copy-on-write.
        self.enable_prefix_caching = enable_prefix_caching and not self.contiguous
        self.max_model_len = max_model_len
        self.blocks_per_reservation = cdiv(max_model_len, block_size)
        self.prefix_cache_queries = 0   # tokens looked up
        self.prefix_cache_hits = 0      # tokens found
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_copy_on_write_blocks = 0   # cumulative
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.blocks_to_swap_out: list[tuple[int, int]] = []
        self.blocks_to_swap_in: list[tuple[int, int]] = []

    # ---- sizing ---------------------------------------------------------------------------------

    def max_request_tokens(self, n: int) -> int:
        """The longest prompt plus reply one request of ``n`` samples may have: the inverse of
        max_blocks_needed (0 when none fits)."""
        return max_request_tokens(n, self.block_pool.num_blocks, self.block_size, self.max_model_len,
                                  self.contiguous)

    def max_blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int) -> int:
        """Blocks a request may hold at its peak, assuming no sharing (a recomputed n>1 request has none)."""
        if self.contiguous:
            return n * self.blocks_per_reservation
        # The last sampled token is never written to the cache.
        return n * cdiv(num_prompt_tokens + max_tokens - 1, self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------------

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        hashes, tokens, bs = seq.block_hashes, seq.token_ids, self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else 0, tokens[i * bs:(i + 1) * bs]))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """The longest run of cached full blocks matching the sequence; the last token is always computed."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hits = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.block_pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation -----------------------------------------------------------------------------

    def allocate_for_admission(self, request: Request, plan: list[tuple[Sequence, int]],
                               hits: dict[int, list[int]]) -> bool:
        """Admit a request from waiting: prefix hits plus new blocks for the planned tokens (or the
        contiguous reservation). ``hits`` maps sample index to its cached blocks; when this returns True,
        each planned sample has its hits' tokens computed, and the caller records that."""
        pool = self.block_pool
        if self.contiguous:
            seqs = request.live_seqs()
            need = len(seqs) * self.blocks_per_reservation
            if need > pool.num_free_blocks:
                return False
            for seq in seqs:
                seq.block_table = tuple(pool.allocate(self.blocks_per_reservation))
            return True
        bs = self.block_size
        need = sum(cdiv(len(hits[seq.index]) * bs + num_new, bs) - len(hits[seq.index])
                   for seq, num_new in plan)
        free_hits = {block for seq, _ in plan for block in hits[seq.index] if pool.ref_counts[block] == 0}
        if need > pool.num_free_blocks - len(free_hits):
            return False
        # Take every hit before allocating anything, or an allocation could evict a block another sample hit.
        for seq, _ in plan:
            pool.touch(hits[seq.index])
        for seq, num_new in plan:
            cached = hits[seq.index]
            num_cached = len(cached) * bs
            missing = cdiv(num_cached + num_new, bs) - len(cached)
            seq.block_table = (*cached, *pool.allocate(missing))
            if self.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_cached
        return True

    def allocate_slots(self, request: Request, plan: list[tuple[Sequence, int]]) -> bool:
        """Blocks for a running request's planned tokens, copying shared partial blocks before a write."""
        pool = self.block_pool
        need, copy_on_write = self._count_growth(request, plan, pool, on_host=False)
        if need > pool.num_free_blocks:
            return False
        for seq, group in copy_on_write:
            self._copy_last_block(seq, group)
        bs = self.block_size
        for seq, num_new in plan:
            missing = cdiv(seq.num_computed_tokens + num_new, bs) - len(self._tables(seq, False)[0])
            if missing > 0:
                self._grow(seq, missing)
        return True

    def _grow(self, seq: Sequence, missing: int) -> None:
        """Append ``missing`` new blocks to each of the sample's tables."""
        seq.block_table += tuple(self.block_pool.allocate(missing))

    def append_slot(self, seq: Sequence) -> bool:
        """Room for one more token of an unshared sample; False, changing nothing, if no block is free."""
        if seq.num_computed_tokens < len(seq.block_table) * self.block_size:
            return True
        if not self.block_pool.free_block_queue:
            return False
        seq.block_table += tuple(self.block_pool.allocate(1))
        return True

    def _count_growth(self, request: Request, plan, pool: BlockPool,
                      on_host: bool) -> tuple[int, list[tuple[Sequence, int]]]:
        """Blocks the plan needs, and the (sample, group) whose next write lands in a block another sample shares."""
        bs = self.block_size
        shares = request.params.n > 1 and not self.contiguous
        pending_refs: dict[int, int] = {}
        need = 0
        copy_on_write = []
        for seq, num_new in plan:
            start = seq.num_computed_tokens
            for group, table in enumerate(self._tables(seq, on_host)):
                if shares and start % bs and num_new:
                    block = table[start // bs]
                    refs = pending_refs.get(block, int(pool.ref_counts[block]))
                    if refs > 1:    # the last sharer to write keeps the original block
                        pending_refs[block] = refs - 1
                        copy_on_write.append((seq, group))
                        need += 1
                need += max(0, cdiv(start + num_new, bs) - len(table))
        return need, copy_on_write

    def _tables(self, seq: Sequence, on_host: bool) -> tuple[tuple[int, ...], ...]:
        """The sample's block tables, one per KV-cache group: here, the one."""
        return (seq.host_block_table if on_host else seq.block_table,)

    def _set_table(self, seq: Sequence, group: int, table: tuple[int, ...]) -> None:
        seq.block_table = table

    def _copy_last_block(self, seq: Sequence, group: int) -> None:
        pool = self.block_pool
        index = seq.num_computed_tokens // self.block_size
        table = self._tables(seq, False)[group]
        src = table[index]
        dst = pool.allocate(1, group)[0]
        pool.fill[dst] = pool.fill[src]     # allocate() marked dst
        self._set_table(seq, group, (*table[:index], dst, *table[index + 1:]))
        pool.free([src])
        self.blocks_to_copy.append((src, dst))
        pool.kv_event_queue.append(CopyOnWrite(seq.index, src, dst))
        self.num_copy_on_write_blocks += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give a sample the parent's computed prompt: shared blocks when paged, copies when contiguous.
        The caller gives it the parent's num_computed_tokens."""
        pool = self.block_pool
        child.block_hashes = list(parent.block_hashes)
        if self.contiguous:
            for i in range(cdiv(parent.num_computed_tokens, self.block_size)):
                src, dst = parent.block_table[i], child.block_table[i]
                pool.fill[dst] = pool.fill[src]
                pool.mark((dst,))
                self.blocks_to_copy.append((src, dst))
            return
        child.block_table = parent.block_table
        pool.incref(child.block_table)

    def commit(self, seq: Sequence, old: int, num_new: int) -> None:
        """The runner computed the sample's tokens ``old .. old + num_new - 1``: record block fill and cache
        the blocks now full. The caller advances num_computed_tokens."""
        bs = self.block_size
        new = old + num_new
        if num_new == 1:    # a decode, as fill_blocks writes it: inline, for it runs for every request every step
            pool = self.block_pool
            block = seq.block_table[old // bs]
            pool.fill[block] = old % bs + 1
            pool.mark_one(block)
            if new % bs:
                return      # the block is not full yet: nothing to cache
        else:
            fill_blocks(self.block_pool, seq.block_table, old, new)
        if self.enable_prefix_caching and new // bs > old // bs:
            self._extend_hashes(seq, new // bs)
            self._register(seq, old // bs, new // bs)

    def _register(self, seq: Sequence, first: int, end: int) -> None:
        """Offer the sample's full blocks ``first .. end - 1`` to the prefix cache."""
        bs, hashes, tokens, table = self.block_size, seq.block_hashes, seq.token_ids, seq.block_table
        for i in range(first, end):
            self.block_pool.register(table[i], hashes[i], hashes[i - 1] if i else None, tokens[i * bs:(i + 1) * bs])

    # ---- freeing --------------------------------------------------------------------------------

    def free_sequence(self, seq: Sequence) -> None:
        """Release a sample's blocks, last block first so a prefix's end is evicted before its start."""
        if seq.block_table:
            self.block_pool.free(reversed(seq.block_table))
            seq.block_table = ()
        if seq.host_block_table:
            self.host_pool.free(reversed(seq.host_block_table))
            seq.host_block_table = ()

    def free_request(self, request: Request) -> None:
        for seq in request.seqs:
            self.free_sequence(seq)

    def recover(self, keep: list[Sequence], drop: list[Sequence]) -> None:
        """A step failed part-way: free the samples in ``drop`` and make both pools agree with ``keep``.

        Undoing the step's changes one by one would need to know where it stopped; recounting from
        the tables that remain does not. The step's pending cache moves are dropped with it.
        """
        forget = {block for seq in drop for block in seq.block_table}
        for seq in drop:
            seq.block_table = seq.host_block_table = ()
        self.block_pool.rebuild([seq.block_table for seq in keep], forget)
        self.host_pool.rebuild([seq.host_block_table for seq in keep], ())
        self.take_cache_moves()
        # Copies of a step that did not happen (the counter keeps them); the prefix cache's changes did happen.
        pool = self.block_pool
        pool.kv_event_queue = [event for event in pool.kv_event_queue if type(event) is not CopyOnWrite]

    # ---- swap -----------------------------------------------------------------------------------

    def swap_out(self, request: Request) -> bool:
        """Move a request's device blocks to the host pool; False, changing nothing, if it is short."""
        seqs = [seq for seq in request.seqs if seq.block_table]
        moved = self._move_tables(seqs, self.block_pool, self.host_pool, to_host=True)
        if moved is None:
            return False
        self.blocks_to_swap_out.extend(moved)
        self.num_swapped_out_blocks += len(moved)
        return True

    def swap_in(self, request: Request, plan: list[tuple[Sequence, int]]) -> bool:
        """Bring a swapped request back and allocate its planned tokens, atomically."""
        seqs = [seq for seq in request.seqs if seq.host_block_table]
        num_unique = len({block for seq in seqs for block in seq.host_block_table})
        growth, _ = self._count_growth(request, plan, self.host_pool, on_host=True)
        if num_unique + growth > self.block_pool.num_free_blocks:
            return False
        moved = self._move_tables(seqs, self.host_pool, self.block_pool, to_host=False)
        self.blocks_to_swap_in.extend(moved)
        self.num_swapped_in_blocks += len(moved)
        if self.enable_prefix_caching:
            for seq in seqs:
                self._register(seq, 0, min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes)))
        allocated = self.allocate_slots(request, plan)
        assert allocated, "swap_in counted its blocks"
        return True

    def _move_tables(self, seqs: list[Sequence], src_pool: BlockPool, dst_pool: BlockPool,
                     to_host: bool) -> list[tuple[int, int]] | None:
        """Map every distinct block of the samples' tables to a new block of dst_pool, keeping sharing."""
        tables = [seq.block_table if to_host else seq.host_block_table for seq in seqs]
        unique = list(dict.fromkeys(block for table in tables for block in table))
        if len(unique) > dst_pool.num_free_blocks:
            return None
        targets = dst_pool.allocate(len(unique))
        mapping = dict(zip(unique, targets, strict=True))
        dst_pool.fill[targets] = src_pool.fill[unique]
        for seq, table in zip(seqs, tables, strict=True):
            new_table = tuple(mapping[block] for block in table)
            src_pool.free(reversed(table))
            if to_host:
                seq.host_block_table, seq.block_table = new_table, ()
            else:
                seq.block_table, seq.host_block_table = new_table, ()
        # allocate() gave each target one reference; samples sharing a block add the rest.
        refs = np.bincount(np.asarray([mapping[b] for table in tables for b in table], dtype=np.int64),
                           minlength=dst_pool.num_blocks)
        dst_pool.ref_counts[targets] = refs[targets]
        dst_pool.mark(targets)
        return list(zip(unique, targets, strict=True))

    # ---- per-step drains and the state copy -----------------------------------------------------

    def take_events(self) -> list:
        """What the cache did since the last call, oldest first: the device pool's KV-cache events (BlockStored,
        BlockRemoved, AllBlocksCleared) and CopyOnWrite records. Empty on most calls, and cheap then."""
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_cache_moves(self) -> tuple[tuple, tuple, tuple]:
        moves = (tuple(self.blocks_to_swap_out), tuple(self.blocks_to_swap_in), tuple(self.blocks_to_copy))
        self.blocks_to_swap_out.clear()
        self.blocks_to_swap_in.clear()
        self.blocks_to_copy.clear()
        return moves

    def copy_state(self, advance: bool = True) -> KVCacheState:
        """Publish the device pool's changes since the last step as a new version; O(blocks changed).
        ``advance=False`` (a look between steps) leaves them to be reported by the next step too."""
        pool, host = self.block_pool, self.host_pool
        blocks, fill_total = self.publisher.publish(pool, advance)
        return KVCacheState(
            blocks, pool.num_blocks, pool.fill, pool.num_free_blocks, pool.num_cached_free_blocks, host.num_blocks,
            host.num_free_blocks, fill_total - pool.num_cached_free_blocks * self.block_size,
            self.prefix_cache_queries, self.prefix_cache_hits, self.num_swapped_out_blocks,
            self.num_swapped_in_blocks, self.num_copy_on_write_blocks, pool.num_evicted_blocks)

