"""check_invariants(engine): the pool's invariants (every block free or referenced, ref counts equal to the
block-table entries, free + used == total, nothing held once idle), checked against the engine's internals.

Call it after every step (pass the StepResult to also check the stats and the
snapshot against the engine). Works with the fake runner and the real one.
run_checked steps to the end checking them; record_batches keeps what the runner
was asked to do. KVEventReplica rebuilds the prefix cache from the steps'
kv_events alone, as a subscriber to vLLM's KV-cache events does, and checks it
against each step's snapshot. GeneratedTokens holds a step's token count to its outputs. The engine's list
of a step's finished outputs is held to its outputs with the step's other checks. TableGrowth holds the engine
to RequestView's promise that a one-sample table only grows until its request is preempted (the engine
process's wire sends tables by that promise).
"""

from __future__ import annotations

import numpy as np

from kvscope.engine.block_pool import NULL_BLOCK
from kvscope.engine.hybrid_kv_cache_manager import group_hash, held
from kvscope.engine.kv_cache_groups import blocks_per_sequence, first_needed_block
from kvscope.engine.kv_cache_manager import cdiv, hash_block
from kvscope.engine.outputs import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED, AllBlocksCleared, BlockRemoved, BlockStored
from kvscope.engine.request import RequestStatus


def check_invariants(engine, result=None) -> None:
    scheduler = engine.scheduler
    kv = scheduler.kv
    requests = list(scheduler.requests.values())
    _check_queues(scheduler, requests)
    _check_pool(kv.block_pool, [seq.block_table for r in requests for seq in r.seqs])
    _check_host_pool(kv.host_pool, [seq.host_block_table for r in requests for seq in r.seqs])
    for request in requests:
        _check_request(kv, request)
    if not requests:
        _check_idle(kv)
    if result is not None:
        _check_result(engine, result)


def _check_queues(scheduler, requests) -> None:
    queues = {"running": scheduler.running, "waiting": list(scheduler.waiting), "swapped": scheduler.swapped}
    seen = [r.request_id for queue in queues.values() for r in queue]
    assert len(seen) == len(set(seen)), "a request is in two queues"
    assert set(seen) == {r.request_id for r in requests}, "queues and the request table disagree"
    for name, queue in queues.items():
        assert all(r.status == name for r in queue), f"status does not match queue {name}"
    for queue in (scheduler.running, scheduler.swapped):
        arrivals = [r.arrival_index for r in queue]
        assert arrivals == sorted(arrivals), "running/swapped must be in arrival order"
    assert len(scheduler.running) <= scheduler.max_num_seqs


def _check_pool(pool, tables) -> None:
    n = pool.num_blocks
    entries = np.asarray([b for table in tables for b in table], dtype=np.int64)
    expected = np.bincount(entries, minlength=n) if len(entries) else np.zeros(n, dtype=np.int64)
    assert len(expected) == n, "a block table points outside the pool"
    bad = np.flatnonzero(pool.ref_counts != expected)
    assert not len(bad), f"ref counts differ from block-table entries at blocks {bad.tolist()}"
    free = set(pool.free_block_queue)
    assert len(free) == len(pool.free_block_queue)
    assert free == set(np.flatnonzero(pool.ref_counts == 0).tolist()), "free queue != blocks with ref count 0"
    assert pool.num_free_blocks + pool.num_used_blocks == n
    hashed = pool.hashes != 0
    unreferenced = pool.ref_counts == 0
    assert (pool.state[~unreferenced] == BLOCK_USED).all()
    assert (pool.state[unreferenced & hashed] == BLOCK_CACHED).all()
    assert (pool.state[unreferenced & ~hashed] == BLOCK_FREE).all()
    assert pool.num_cached_free_blocks == int((unreferenced & hashed).sum())
    assert (pool.fill[unreferenced & ~hashed] == 0).all(), "a free block claims filled slots"
    assert ((pool.fill >= 0) & (pool.fill <= pool.block_size)).all()
    assert (pool.fill[hashed] == pool.block_size).all(), "only full blocks may be cached"
    assert len(pool.cached_blocks) == int(hashed.sum())
    for block_hash, block in pool.cached_blocks.items():
        assert int(pool.hashes[block]) == block_hash, "prefix-cache map and block hashes disagree"


def _check_host_pool(pool, tables) -> None:
    n = pool.num_blocks
    entries = np.asarray([b for table in tables for b in table], dtype=np.int64)
    expected = np.bincount(entries, minlength=n) if len(entries) else np.zeros(n, dtype=np.int64)
    assert (pool.ref_counts == expected[:n]).all() and len(expected) == n, "host ref counts are wrong"
    assert set(pool.free_block_queue) == set(np.flatnonzero(pool.ref_counts == 0).tolist())


def _check_request(kv, request) -> None:
    bs = kv.block_size
    assert request.status != RequestStatus.FINISHED
    for seq in request.seqs:
        if seq.finish_reason is not None:
            assert not seq.block_table and not seq.host_block_table, "a finished sample holds blocks"
            continue
        assert 0 <= seq.num_computed_tokens < seq.num_tokens, "a live sample's last token is never computed"
        assert seq.num_output_tokens <= request.params.max_tokens
        if request.status == RequestStatus.WAITING:
            assert not seq.block_table and not seq.host_block_table and seq.num_computed_tokens == 0
            assert not seq.group_tables and not seq.host_group_tables
        elif getattr(kv, "groups", None):
            _check_group_tables(kv, request, seq)
            continue
        elif request.status == RequestStatus.SWAPPED:
            assert not seq.block_table
            assert len(seq.host_block_table) == cdiv(seq.num_computed_tokens, bs)
        elif kv.contiguous:
            assert len(seq.block_table) == kv.blocks_per_reservation
        else:
            assert len(seq.block_table) == cdiv(seq.num_computed_tokens, bs), "table does not match computed"
        for i in range(min(seq.num_computed_tokens // bs, len(seq.block_hashes), len(seq.block_table))):
            block_hash = int(kv.block_pool.hashes[seq.block_table[i]])
            assert block_hash in (0, seq.block_hashes[i]), "a block's cached hash does not match its content"


def _check_group_tables(kv, request, seq) -> None:
    """Per KV-cache group: one table each, as long as the computed tokens need, NULL only where a sliding window
    freed blocks no query can see any more, and the sample's block_table every block held, group after group."""
    bs, computed = kv.block_size, seq.num_computed_tokens
    swapped = request.status == RequestStatus.SWAPPED
    tables = seq.host_group_tables if swapped else seq.group_tables
    assert not (seq.group_tables if swapped else seq.host_group_tables), "tables in both pools"
    if not tables:  # a sample that has not forked yet
        assert not computed and not seq.block_table and not seq.host_block_table
        return
    assert len(tables) == len(kv.groups), "one table per group"
    assert (seq.host_block_table if swapped else seq.block_table) == held(tables), "block_table != groups' blocks"
    for group, (window, table) in enumerate(zip(kv.windows, tables, strict=True)):
        assert len(table) == cdiv(computed, bs), f"group {group}'s table does not match computed"
        live = [i for i, block in enumerate(table) if block != NULL_BLOCK]
        assert live == list(range(len(table) - len(live), len(table))), "NULL entries are only leading ones"
        if window is None:
            assert len(live) == len(table), "a full group never frees a block a request holds"
            continue
        assert len(table) - len(live) <= first_needed_block(computed, window, bs), "freed a block still visible"
        cap = blocks_per_sequence((kv.groups[group],), kv.max_model_len, bs, kv.chunk)
        assert len(live) <= cap, f"a sliding group holds {len(live)} blocks, more than its {cap}"
        if swapped:
            continue
        for i in live:
            if i < min(computed // bs, len(seq.block_hashes)):
                block_hash = int(kv.block_pool.hashes[table[i]])
                assert block_hash in (0, group_hash(seq.block_hashes[i], group)), "a cached hash is wrong"


def _check_idle(kv) -> None:
    pool, host = kv.block_pool, kv.host_pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert not pool.ref_counts.any() and not host.ref_counts.any(), "ref counts leaked"
    assert (pool.state != BLOCK_USED).all()
    assert host.num_free_blocks == host.num_blocks, "host blocks leaked"


def _check_result(engine, result) -> None:
    scheduler = engine.scheduler
    pool = scheduler.kv.block_pool
    stats, snap = result.stats, result.snapshot
    # The engine says which outputs finished as it makes them (StepResult.knowing_finished): none missed, none
    # extra, in output order.
    finished = [output for output in result.outputs if output.finished]
    assert [id(output) for output in result.finished_outputs] == [id(output) for output in finished], \
        f"step {stats.step}: finished outputs {[o.request_id for o in result.finished_outputs]}, " \
        f"its outputs that finished {[o.request_id for o in finished]}"
    assert stats.num_running == len(scheduler.running)
    assert stats.num_waiting == len(scheduler.waiting)
    assert stats.num_swapped == len(scheduler.swapped)
    assert stats.num_free_blocks == pool.num_free_blocks
    assert stats.num_cached_free_blocks == pool.num_cached_free_blocks
    assert stats.num_total_blocks == pool.num_blocks
    assert 0.0 <= stats.kv_usage <= 1.0 and 0.0 <= stats.kv_token_utilisation <= 1.0
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries
    assert np.array_equal(snap.ref_counts, pool.ref_counts) and np.array_equal(snap.block_state, pool.state)
    assert np.array_equal(snap.block_fill, pool.fill) and np.array_equal(snap.block_hashes, pool.hashes)
    assert snap.ref_counts is not pool.ref_counts, "the snapshot must own its arrays"
    for array in (snap.block_state, snap.ref_counts, snap.block_fill, snap.block_hashes):
        assert not array.flags.writeable, "a snapshot's arrays are read-only, live or replayed"
    views = {view.request_id: view for view in snap.requests}
    assert set(views) == set(scheduler.requests)
    for request_id, request in scheduler.requests.items():
        view = views[request_id]
        live = [seq for seq in request.seqs if seq.finish_reason is None]
        assert view.queue == request.status
        assert view.block_tables == tuple(tuple(seq.block_table) for seq in live)
        if any(seq.group_tables for seq in live):
            assert view.group_block_tables == tuple(seq.group_tables for seq in live)
        assert view.num_output_tokens == request.seqs[0].num_output_tokens
        assert view.num_computed_tokens == request.seqs[0].num_computed_tokens
        assert view.used_slots <= view.reserved_slots
    owners = np.zeros(pool.num_blocks, dtype=np.int64)
    for view in snap.requests:
        for table in view.block_tables:
            np.add.at(owners, list(table), 1)
    assert np.array_equal(owners, snap.ref_counts), "snapshot tables do not explain the ref counts"
    _check_group_counters(scheduler.kv, stats, scheduler.requests.values())


def _check_group_counters(kv, stats, requests) -> None:
    """Per group: the blocks in use are those its tables hold, and a full group's window frees nothing."""
    if not kv.groups:
        assert stats.group_held_blocks == stats.window_freed_blocks == stats.window_freed_step == ()
        return
    tables = [seq.group_tables for r in requests for seq in r.seqs if seq.group_tables]
    held_per_group = tuple(len({b for t in tables for b in t[group] if b != NULL_BLOCK})
                           for group in range(len(kv.groups)))
    assert stats.group_held_blocks == held_per_group, "blocks in use per group != the groups' tables"
    assert sum(held_per_group) == stats.num_total_blocks - stats.num_free_blocks
    assert len(stats.window_freed_blocks) == len(stats.window_freed_step) == len(kv.groups)
    for group, window in enumerate(kv.windows):
        assert 0 <= stats.window_freed_step[group] <= stats.window_freed_blocks[group]
        if window is None:
            assert stats.window_freed_blocks[group] == 0, "a full group's window freed blocks"


def run_checked(engine, max_steps: int = 10_000, on_step=None) -> list:
    """Step until idle, checking invariants after every step; returns every RequestOutput produced."""
    outputs, growth = [], TableGrowth()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        result = engine.step()
        check_invariants(engine, result)
        growth.step(result)
        outputs.extend(result.outputs)
        if on_step is not None:
            on_step(result)
    else:
        raise AssertionError(f"engine did not finish within {max_steps} steps")
    check_invariants(engine)
    return outputs


def record_batches(engine) -> list:
    """The list every ScheduledBatch the engine hands its runner from now on is appended to."""
    batches = []
    execute = engine.runner.execute

    def recording_execute(batch):
        batches.append(batch)
        return execute(batch)

    engine.runner.execute = recording_execute
    return batches


class BlockArraysReplica:
    """The per-block arrays as a consumer of each step's published changes sees them: ``step(result, pool)``
    applies the snapshot's changes (or takes its arrays whole where it has none) and asserts the replica equals
    the pool's own arrays. The replica never reads a snapshot's arrays when it has changes to apply."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] | None = None

    def step(self, result, pool) -> None:
        blocks = result.snapshot.blocks
        if blocks.changes is None or self.arrays is None:
            self.arrays = [array.copy() for array in blocks.arrays()]
        else:
            for array, values in zip(self.arrays, blocks.changes.values, strict=True):
                array[blocks.changes.indices] = values
        for name, have, want in zip(("state", "ref counts", "fill", "hashes"), self.arrays,
                                    (pool.state, pool.ref_counts, pool.fill, pool.hashes), strict=True):
            assert np.array_equal(have, want), f"replaying the published changes gives other {name}"


class TableGrowth:
    """RequestView's promise, across steps: the block table of a request with one sample and one KV-cache group
    only grows (each step's extends the last) while its num_preemptions stays. ``step(result)`` checks it."""

    def __init__(self) -> None:
        self.seen: dict[str, object] = {}
        self.checked = 0

    def step(self, result) -> None:
        now = {view.request_id: view for view in result.snapshot.requests}
        for request_id, view in now.items():
            before = self.seen.get(request_id)
            if (before is None or view.num_samples != 1 or view.group_block_tables
                    or (before.arrival_index, before.num_preemptions) != (view.arrival_index, view.num_preemptions)):
                continue
            (old,), (new,) = before.block_tables, view.block_tables
            assert new[:len(old)] == old, f"{request_id}'s table changed other than by growing, not preempted"
            self.checked += 1
        self.seen = now


class GeneratedTokens:
    """The step's count of generated tokens (StepStats.num_generated_tokens, which the run log and serve's
    metrics take as they are) against its outputs: the growth of every request's output, every sample's.
    ``step(result)`` checks it."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}

    def step(self, result) -> None:
        grown = 0
        for output in result.outputs:
            total = sum(len(sample.token_ids) for sample in output.samples) if output.samples \
                else len(output.token_ids)
            grown += total - self.totals.get(output.request_id, 0)
            self.totals[output.request_id] = total
        assert result.stats.num_generated_tokens == grown, \
            f"step {result.stats.step} counts {result.stats.num_generated_tokens} tokens, its outputs grew {grown}"


class KVEventReplica:
    """The prefix cache as a subscriber sees it: block id -> hash, from BlockStored/BlockRemoved/AllBlocksCleared.

    ``step(result)`` applies one step's kv_events and asserts the replica equals the cached blocks of that
    step's snapshot. Start it with the engine (or with a snapshot whose events have all been reported)."""

    def __init__(self, groups: bool = False) -> None:
        self.groups = groups    # groups key their prefixes by the chain hash mixed with the group's index
        self.cached: dict[int, int] = {}
        self.counts = {BlockStored: 0, BlockRemoved: 0, AllBlocksCleared: 0}

    def step(self, result) -> None:
        self.apply(result.kv_events)
        hashes = result.snapshot.block_hashes
        assert self.cached == {int(b): int(hashes[b]) for b in np.flatnonzero(hashes)}, \
            "replaying kv_events does not give the snapshot's cached blocks"

    def apply(self, events) -> None:
        assert isinstance(events, tuple)
        for event in events:
            self.counts[type(event)] += 1
            if type(event) is BlockStored:
                assert event.block_id not in self.cached, "a block stored twice without a removal"
                assert event.block_hash not in self.cached.values(), "a prefix stored in two blocks"
                assert len(event.token_ids) == event.block_size and isinstance(event.token_ids, tuple)
                assert self.groups or event.block_hash == hash_block(event.parent_block_hash or 0, event.token_ids)
                self.cached[event.block_id] = event.block_hash
            elif type(event) is BlockRemoved:
                assert self.cached.pop(event.block_id, None) == event.block_hash, "removed what was not stored"
            else:
                assert type(event) is AllBlocksCleared
                self.cached.clear()
