"""Immutable pictures of a PoolModel for the window and the run log.

The picture is the app's own CacheSnapshot, so the block map, the block
inspector and replay draw it unchanged. What fills it is what vLLM says:

- an announced block (known from events) is a full, hashed block in its stable
  slot; whether a request still holds it or it sits cached and free, vLLM does
  not say, so every announced block is drawn alike, coloured by prefix tree;
- each prefix tree is the "owner" of its blocks (a RequestView named
  ``prefix-N`` in queue ``prefix``), which is what colours the map by tree and
  lets a click select a whole tree;
- blocks in use that were never announced (partly filled, or not yet hashed)
  are counted from ``kv_cache_usage_perc``: used blocks beyond the announced
  ones, at least, drawn as empty reserved cells in the highest free slots.

Trees that did not change since the previous picture keep their RequestView,
so a picture of a big, busy pool rebuilds only the trees that moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope.app.attach.feed.groups import GroupSeen
from kvscope.app.attach.feed.pool import PoolCounters, PoolModel
from kvscope.engine.outputs import BLOCK_USED, CacheSnapshot, RequestView

PREFIX_QUEUE = "prefix"
MAX_TREES = 64          # the largest trees described in a picture (every tree still colours the map)


@dataclass(frozen=True)
class PrefixTree:
    tree_id: int
    num_blocks: int
    depth: int                  # blocks on its longest path from the root
    num_branches: int           # leaves: distinct sequences now cached under this root
    num_reuses: int             # store events since attach that show a request reusing this prefix
    preview_token_ids: tuple[int, ...]
    preview: str                # decoded text when the model's tokenizer is at hand, else ""
    partial: bool               # the root's own parent was evicted or announced before kvscope attached

    @property
    def name(self) -> str:
        return f"prefix-{self.tree_id}"


@dataclass(frozen=True)
class PoolView:
    label: str                  # "rank 0", or the endpoint too when several publishers are watched
    snapshot: CacheSnapshot
    num_known_blocks: int
    num_in_use_blocks: int | None    # from kv_cache_usage_perc; None before the first metrics sample
    num_unannounced_blocks: int      # in use beyond the announced blocks (a lower bound)
    num_trees: int
    trees: tuple[PrefixTree, ...]    # the MAX_TREES largest, largest first
    counters: PoolCounters
    # The KV-cache groups the events named, with the blocks each holds; groups_named: whether any event named one.
    groups: tuple[GroupSeen, ...] = ()
    groups_named: bool = False

    @property
    def num_blocks(self) -> int:
        return self.snapshot.num_blocks

    @property
    def num_cached_free_at_least(self) -> int:
        """Announced blocks that cannot all be in use: at least this many sit cached and free."""
        if self.num_in_use_blocks is None:
            return 0
        return max(0, self.num_known_blocks - self.num_in_use_blocks)


def in_use_blocks(kv_usage: float, num_blocks: int) -> int:
    """vLLM's usage is used / (num_gpu_blocks - 1): block 0 is its null block, never handed out."""
    return min(num_blocks, round(kv_usage * max(num_blocks - 1, 1)))


class PoolPicture:
    """Makes PoolViews of one PoolModel, reusing what did not change since the last one."""

    def __init__(self, pool: PoolModel, label: str, preview_text=None) -> None:
        self.pool = pool
        self.label = label
        self.preview_text = preview_text or (lambda token_ids: "")
        self._views: dict[int, RequestView] = {}
        self._texts: dict[int, tuple[tuple[int, ...], str]] = {}
        self._shapes: dict[int, tuple[int, int]] = {}

    def view(self, step: int, kv_usage: float | None) -> PoolView:
        pool = self.pool
        in_use = None if kv_usage is None else in_use_blocks(kv_usage, pool.num_blocks)
        band = max(0, in_use - pool.num_known_blocks) if in_use is not None else 0
        trees = self._largest_trees()
        snapshot = CacheSnapshot(step=step, block_size=pool.block_size, num_blocks=pool.num_blocks,
                                 allocator="vllm", **self._arrays(band), requests=self._request_views())
        return PoolView(self.label, snapshot, pool.num_known_blocks, in_use, band, len(pool.trees),
                        tuple(trees), pool.counters, pool.groups.groups(), pool.groups.named)

    def _arrays(self, band: int) -> dict[str, np.ndarray]:
        """The four per-block arrays, fresh copies (the model goes on changing its own). Only the slots
        below the high-water mark are copied: the rest of a big pool has never held a block."""
        pool, size, used = self.pool, self.pool.num_blocks, self.pool.high_water
        known = pool.tree_at[:used] >= 0
        state = np.zeros(size, dtype=np.int8)
        state[:used] = known                    # BLOCK_USED is 1
        self._mark_band(state, known, band)
        fill = np.zeros(size, dtype=np.int16)
        np.multiply(known, pool.block_size, out=fill[:used], casting="unsafe")
        hashes = np.zeros(size, dtype=np.uint64)
        hashes[:used] = pool.hash_at[:used]
        arrays = {"block_state": state, "ref_counts": state.astype(np.int32), "block_fill": fill,
                  "block_hashes": hashes}
        for array in arrays.values():
            array.flags.writeable = False
        return arrays

    @staticmethod
    def _mark_band(state: np.ndarray, known: np.ndarray, band: int) -> None:
        """The unannounced band: the ``band`` highest slots that hold no announced block."""
        beyond = state.size - known.size        # slots never used: all free, and the highest
        if band:
            state[state.size - min(band, beyond):] = BLOCK_USED
        rest = band - beyond
        if rest > 0:
            holes = np.flatnonzero(~known)
            state[holes[-rest:]] = BLOCK_USED

    def _largest_trees(self) -> list[PrefixTree]:
        """Records of the MAX_TREES largest trees (a busy pool has thousands: only these are described)."""
        pool = self.pool
        trees = pool.trees
        ids = pool.tree_row_ids[:pool.tree_rows_used]
        sizes = pool.tree_row_sizes[:pool.tree_rows_used]
        if len(ids) > MAX_TREES:
            keep = np.argpartition(-sizes, MAX_TREES - 1)[:MAX_TREES]
            ids, sizes = ids[keep], sizes[keep]
        live = sizes > 0     # rows of trees that are gone are free, size 0
        ids, sizes = ids[live], sizes[live]
        largest = ids[np.lexsort((ids, -sizes))].tolist()
        changed = self.pool.dirty_trees
        self._update_shapes([t for t in largest if self.pool.all_dirty or t in changed or t not in self._shapes])
        records = []
        for tree_id in largest:
            stats = trees[tree_id]
            depth, branches = self._shapes[tree_id]
            token_ids = tuple(stats.preview)
            records.append(PrefixTree(tree_id, stats.num_blocks, depth, branches, stats.num_reuses, token_ids,
                                      self._text(tree_id, token_ids), stats.partial))
        return records

    def _update_shapes(self, tree_ids: list[int]) -> None:
        """(depth, leaves) of each tree, from one pass over the pool for all of them."""
        if not tree_ids:
            return
        pool = self.pool
        owners = pool.tree_at[:pool.high_water]
        members = np.flatnonzero(np.isin(owners, np.array(tree_ids, dtype=np.int32)))
        owner = owners[members]
        order = np.argsort(owner, kind="stable")
        members, owner = members[order], owner[order]
        starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]]) if owner.size else np.array([], np.int64)
        depth = np.maximum.reduceat(pool.depth_at[members], starts) if owner.size else []
        leaves = np.add.reduceat((pool.children_at[members] == 0).astype(np.int64), starts) if owner.size else []
        for tree_id, d, n in zip(owner[starts].tolist(), np.asarray(depth).tolist(), np.asarray(leaves).tolist()):
            self._shapes[tree_id] = (d + 1, n)

    def _text(self, tree_id: int, token_ids: tuple[int, ...]) -> str:
        cached = self._texts.get(tree_id)
        if cached is None or cached[0] != token_ids:
            cached = self._texts[tree_id] = (token_ids, self.preview_text(token_ids))
        return cached[1]

    def _request_views(self) -> tuple[RequestView, ...]:
        """One view per tree; only the trees events touched since the last picture are rebuilt."""
        pool, views = self.pool, self._views
        if pool.all_dirty:
            gone = [tree_id for tree_id in views if tree_id not in pool.trees]
            stale = list(pool.trees)
        else:
            gone = [tree_id for tree_id in pool.dirty_trees if tree_id not in pool.trees]
            stale = [tree_id for tree_id in pool.dirty_trees if tree_id in pool.trees]  # a new tree is dirty too
        for tree_id in gone:
            views.pop(tree_id, None)
            self._texts.pop(tree_id, None)
            self._shapes.pop(tree_id, None)
        if stale:
            tables = self._block_tables(set(stale))
            for tree_id in stale:
                views[tree_id] = self._request_view(tree_id, tables.get(tree_id, ()))
        pool.dirty_trees.clear()
        pool.all_dirty = False
        return tuple(views.values())

    def _block_tables(self, wanted: set[int]) -> dict[int, tuple[int, ...]]:
        """The slots of each wanted tree, in slot order, from one sort of the pool."""
        pool = self.pool
        slots = np.flatnonzero(pool.tree_at[:pool.high_water] >= 0)
        owners = pool.tree_at[slots]
        keep = np.isin(owners, np.fromiter(wanted, dtype=np.int32, count=len(wanted)))
        slots, owners = slots[keep], owners[keep]
        order = np.argsort(owners, kind="stable")
        slots, owners = slots[order], owners[order]
        starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]]) if owners.size else np.array([], int)
        ends = np.r_[starts[1:], owners.size]
        return {int(owners[a]): tuple(slots[a:b].tolist()) for a, b in zip(starts.tolist(), ends.tolist())}

    def _request_view(self, tree_id: int, table: tuple[int, ...]) -> RequestView:
        stats = self.pool.trees[tree_id]
        tokens = stats.num_blocks * self.pool.block_size
        cached = self._texts.get(tree_id)
        return RequestView(
            request_id=f"prefix-{tree_id}", queue=PREFIX_QUEUE, arrival_index=tree_id, block_tables=(table,),
            host_block_tables=(), num_prompt_tokens=tokens, num_output_tokens=0, max_tokens=0,
            num_computed_tokens=tokens, num_cached_tokens=tokens, num_preemptions=0, num_samples=1,
            reserved_slots=tokens, used_slots=tokens, prompt_preview=cached[1] if cached else "")
