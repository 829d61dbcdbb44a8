"""The KV cache manager for a model with KV-cache groups (engine/kv_cache_groups.py): one block table per group
per sample, every group's blocks from one shared pool.

It keeps KVCacheManager's contract (all-or-nothing allocation, cache moves queued for the runner, counters
advanced by the scheduler) and its representation for everything outside it: a sample's ``block_table`` is
every block it holds, group after group, with no NULL_BLOCK in it, so ref counts, snapshots, events and the
block map read it as they read a one-group table. The per-group tables (Sequence.group_tables) are what the
runner reads.

What a group's kind changes:
- a sliding group frees the blocks that fell wholly out of the window before each allocation for a step
  (decode, chunked prefill, swap-in): no query from then on can see them. This happens even when the
  allocation then fails, as in vLLM: the request could never read them again. Freed blocks that hold a
  cached prefix stay cached.
- prefix caching: a full group hits on the longest cached prefix; a sliding group hits at k blocks only when
  the blocks the first query at position k * B can see are cached. The hit is the longest k every group
  accepts. Each group keys its cached blocks by the prefix hash mixed with the group's index (group 0 keeps
  the plain hash), as vLLM keys them by (hash, group).
- copy-on-write, swap and recompute work table by table: NULL entries stay NULL.

The contiguous allocator never gets here: it is the pre-paging baseline, with one group.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvscope.engine.block_pool import NULL_BLOCK, BlockPool
from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache_groups import KVCacheGroup, blocks_per_sequence, first_needed_block, longest_sequence
from kvscope.engine.kv_cache_manager import _HASH_MASK, KVCacheManager, KVCacheState, cdiv, fill_blocks
from kvscope.engine.request import Request, Sequence

Tables = tuple[tuple[int, ...], ...]


def group_hash(block_hash: int, group: int) -> int:
    """The key of a prefix in one group's part of the prefix cache: group 0 keeps the plain chain hash."""
    # The marker keeps this tuple's shape apart from a chain hash's (parent, token ids...), or group 1's key of a
    # prefix would be the chain hash of that prefix followed by token 1.
    return block_hash if not group else (hash(("kv-cache group", group, block_hash)) & _HASH_MASK) or 1


def held(tables: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    """Every block the tables hold, group after group, NULL entries left out."""
    return tuple(block for table in tables for block in table if block != NULL_BLOCK)


class HybridKVCacheManager(KVCacheManager):
    slot_work_inside_blocks = True  # append_slot frees what left a sliding window, at any position

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int, *, groups: tuple[KVCacheGroup, ...],
                 enable_prefix_caching: bool = True, max_model_len: int, max_num_batched_tokens: int) -> None:
        super().__init__(num_blocks, num_host_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                         allocator="paged", max_model_len=max_model_len)
        self.groups = groups
        self.windows = tuple(group.sliding_window for group in groups)
        self.chunk = max_num_batched_tokens
        self._hits: dict[int, Tables] = {}     # seq_id -> every group's cached prefix, found for admission
        self.block_pool.track_groups(len(groups))
        # Per group, cumulative: table entries a sliding window let go of as requests advanced; and the same at
        # the last published step, so each step reports its own.
        self.window_freed_blocks = [0] * len(groups)
        self._window_freed_published = (0,) * len(groups)

    @property
    def num_window_freed_blocks(self) -> int:
        return sum(self.window_freed_blocks)

    # ---- sizing ---------------------------------------------------------------------------------

    def max_blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int) -> int:
        return n * blocks_per_sequence(self.groups, num_prompt_tokens + max_tokens - 1, self.block_size, self.chunk)

    def max_request_tokens(self, n: int) -> int:
        """The inverse of max_blocks_needed: each sample's tokens but the last fit in its share of the pool."""
        share = self.block_pool.num_blocks // n
        if share == 0:
            return 0
        return 1 + longest_sequence(self.groups, share, self.block_size, self.chunk, self.max_model_len - 1)

    # ---- prefix cache ---------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Group 0's hit table (NULL where a sliding group needs no block); every group's is kept for
        allocate_for_admission. Its length is the blocks hit."""
        self._hits.pop(seq.seq_id, None)
        if not self.enable_prefix_caching:
            return []
        bs, pool = self.block_size, self.block_pool
        max_blocks = (seq.num_tokens - 1) // bs
        self._extend_hashes(seq, max_blocks)
        hashes = seq.block_hashes
        limit = max_blocks
        for group, window in enumerate(self.windows):
            if window is None:
                found = 0
                while found < limit and pool.lookup(group_hash(hashes[found], group)) is not None:
                    found += 1
                limit = found
        for blocks in range(limit, 0, -1):
            tables = self._hit_tables(hashes, blocks)
            if tables is not None:
                self._hits[seq.seq_id] = tables
                return list(tables[0])
        return []

    def _hit_tables(self, hashes: list[int], blocks: int) -> Tables | None:
        """Every group's table for a hit of ``blocks`` blocks, or None if a sliding group lacks one it needs."""
        pool, tables = self.block_pool, []
        for group, window in enumerate(self.windows):
            first = 0 if window is None else first_needed_block(blocks * self.block_size, window, self.block_size)
            table = [NULL_BLOCK] * first
            for i in range(first, blocks):
                block = pool.lookup(group_hash(hashes[i], group))
                if block is None:
                    return None
                table.append(block)
            tables.append(tuple(table))
        return tuple(tables)

    # ---- allocation -----------------------------------------------------------------------------

    def allocate_for_admission(self, request: Request, plan: list[tuple[Sequence, int]],
                               hits: dict[int, list[int]]) -> bool:
        pool, bs = self.block_pool, self.block_size
        empty: Tables = ((),) * len(self.groups)
        found = {seq.seq_id: self._hits.get(seq.seq_id, empty) for seq, _ in plan}
        self._hits.clear()  # found for this admission only: a failed one looks again next step
        need = 0
        hit_blocks = set()
        for seq, num_new in plan:
            tables = found[seq.seq_id]
            num_hit = len(tables[0])
            need += len(self.groups) * (cdiv(num_hit * bs + num_new, bs) - num_hit)
            hit_blocks.update(held(tables))
        free_hits = sum(1 for block in hit_blocks if pool.ref_counts[block] == 0)
        if need > pool.num_free_blocks - free_hits:
            return False
        for seq, _ in plan:     # every hit first, or an allocation could evict a block another sample hit
            pool.touch(held(found[seq.seq_id]))
        for seq, num_new in plan:
            tables = found[seq.seq_id]
            num_hit = len(tables[0])
            missing = cdiv(num_hit * bs + num_new, bs) - num_hit
            self._set_tables(seq, tuple((*table, *pool.allocate(missing, group))
                                        for group, table in enumerate(tables)))
            if self.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_hit * bs
        return True

    def allocate_slots(self, request: Request, plan: list[tuple[Sequence, int]]) -> bool:
        for seq, _ in plan:
            if not seq.group_tables:    # a sample the admission's budget did not reach
                seq.group_tables = ((),) * len(self.groups)
            self._free_out_of_window(seq)
        return super().allocate_slots(request, plan)

    def _grow(self, seq: Sequence, missing: int) -> None:
        self._set_tables(seq, tuple((*table, *self.block_pool.allocate(missing, group))
                                    for group, table in enumerate(seq.group_tables)))

    def append_slot(self, seq: Sequence) -> bool:
        self._free_out_of_window(seq)
        tables = seq.group_tables
        if seq.num_computed_tokens < len(tables[0]) * self.block_size:
            return True
        if len(self.block_pool.free_block_queue) < len(tables):
            return False
        self._set_tables(seq, tuple((*table, *self.block_pool.allocate(1, group))
                                    for group, table in enumerate(tables)))
        return True

    def _free_out_of_window(self, seq: Sequence) -> None:
        """Give back the sliding groups' blocks that no query from num_computed_tokens on can see."""
        start, bs = seq.num_computed_tokens, self.block_size
        tables, freed = list(seq.group_tables), []
        for group, window in enumerate(self.windows):
            table = tables[group]
            if window is None:
                continue
            first = min(first_needed_block(start, window, bs), len(table))
            if first and table[first - 1] != NULL_BLOCK:
                gone = [block for block in table[:first] if block != NULL_BLOCK]
                freed.extend(reversed(gone))
                self.window_freed_blocks[group] += len(gone)
                tables[group] = (NULL_BLOCK,) * first + table[first:]
        if freed:
            self.block_pool.free(freed)
            self._set_tables(seq, tuple(tables))

    def _set_tables(self, seq: Sequence, tables: Tables) -> None:
        seq.group_tables = tables
        seq.block_table = held(tables)

    def _tables(self, seq: Sequence, on_host: bool) -> Tables:
        return seq.host_group_tables if on_host else seq.group_tables

    def _set_table(self, seq: Sequence, group: int, table: tuple[int, ...]) -> None:
        tables = list(seq.group_tables)
        tables[group] = table
        self._set_tables(seq, tuple(tables))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_hashes = list(parent.block_hashes)
        child.group_tables, child.block_table = parent.group_tables, parent.block_table
        self.block_pool.incref(child.block_table)

    def commit(self, seq: Sequence, old: int, num_new: int) -> None:
        bs = self.block_size
        new = old + num_new
        for table in seq.group_tables:
            fill_blocks(self.block_pool, table, old, new)
        if self.enable_prefix_caching and new // bs > old // bs:
            self._extend_hashes(seq, new // bs)
            self._register(seq, old // bs, new // bs)

    def _register(self, seq: Sequence, first: int, end: int) -> None:
        bs, hashes, tokens = self.block_size, seq.block_hashes, seq.token_ids
        for group, table in enumerate(seq.group_tables):
            for i in range(first, end):
                if table[i] != NULL_BLOCK:
                    parent = group_hash(hashes[i - 1], group) if i else None
                    self.block_pool.register(table[i], group_hash(hashes[i], group), parent,
                                             tokens[i * bs:(i + 1) * bs])

    # ---- freeing --------------------------------------------------------------------------------

    def free_sequence(self, seq: Sequence) -> None:
        super().free_sequence(seq)
        seq.group_tables = seq.host_group_tables = ()

    def recover(self, keep: list[Sequence], drop: list[Sequence]) -> None:
        for seq in drop:
            seq.group_tables = seq.host_group_tables = ()
        super().recover(keep, drop)

    # ---- swap -----------------------------------------------------------------------------------

    def _move_tables(self, seqs: list[Sequence], src_pool: BlockPool, dst_pool: BlockPool,
                     to_host: bool) -> list[tuple[int, int]] | None:
        group_tables = [seq.group_tables if to_host else seq.host_group_tables for seq in seqs]
        moved = super()._move_tables(seqs, src_pool, dst_pool, to_host)
        if moved is None:
            return None
        mapping = dict(moved)
        mapping[NULL_BLOCK] = NULL_BLOCK
        for seq, tables in zip(seqs, group_tables, strict=True):
            new_tables = tuple(tuple(mapping[block] for block in table) for table in tables)
            if to_host:
                seq.host_group_tables, seq.group_tables = new_tables, ()
            else:
                seq.group_tables, seq.host_group_tables = new_tables, ()
                for group, table in enumerate(new_tables[1:], start=1):    # allocate() took them for group 0
                    dst_pool.assign_group(dict.fromkeys(b for b in table if b != NULL_BLOCK), group)
        return moved

    # ---- the state copy -------------------------------------------------------------------------

    def copy_state(self, advance: bool = True) -> KVCacheState:
        """The one-group state, with each group's blocks in use and what its window let go of."""
        state = super().copy_state(advance)
        freed = tuple(self.window_freed_blocks)
        step = tuple(now - before for now, before in zip(freed, self._window_freed_published, strict=True))
        if advance:
            self._window_freed_published = freed
        return state._replace(group_held_blocks=tuple(self.block_pool.group_held), window_freed_blocks=freed,
                              window_freed_step=step)


def make_kv_cache_manager(config: EngineConfig, num_blocks: int, num_host_blocks: int, block_size: int,
                          max_model_len: int, groups: tuple[KVCacheGroup, ...]) -> KVCacheManager:
    """The manager for this model's groups: the one-group manager unless the paged allocator has groups."""
    if groups and config.allocator == "paged":
        return HybridKVCacheManager(num_blocks, num_host_blocks, block_size, groups=groups,
                                    enable_prefix_caching=config.enable_prefix_caching,
                                    max_model_len=max_model_len,
                                    max_num_batched_tokens=config.max_num_batched_tokens)
    return KVCacheManager(num_blocks, num_host_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching,
                          allocator=config.allocator, max_model_len=max_model_len)
