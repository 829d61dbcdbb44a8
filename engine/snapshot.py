"""What a step reports besides its outputs: the cache snapshot and the step's counters.

Both only read: the scheduler's queues, and one published version of the KV cache's state
(Scheduler.cache_state(): the blocks changed since the last version, the whole arrays built only when read).
The snapshot reuses each waiting or swapped request's view until the scheduler drops it
(Scheduler.update_from_output), so a step that touched few of them builds few views; the running requests' views,
which a decode step changes all of, are captured in a few values each and built when read
(engine/request_columns.py).
"""

from __future__ import annotations

from typing import NamedTuple

from kvscope.engine.kv_cache_manager import KVCacheState
from kvscope.engine.outputs import CacheSnapshot, RequestView, StepStats
from kvscope.engine.request import Request, Sequence
from kvscope.engine.request_columns import CapturedViews, one_sample_view
from kvscope.engine.scheduler import Scheduler


class PhaseTimes(NamedTuple):
    """perf_counter() readings taken through one step."""

    start: float
    scheduled: float
    executed: float
    updated: float
    snapshotted: float


def build_snapshot(scheduler: Scheduler, cache: KVCacheState, step: int, allocator: str) -> CacheSnapshot:
    running = scheduler.running
    rest = [request_view(request, scheduler, cache) for queue in (scheduler.swapped, scheduler.waiting)
            for request in queue]
    # Each running request changed this step (most do): its view is built when a consumer asks.
    requests = CapturedViews.capture(running, tuple(rest), scheduler.block_size, scheduler.kv.groups)
    if requests is None:
        requests = (*(request_view(request, scheduler, cache) for request in running), *rest)
    return CacheSnapshot(step=step, block_size=scheduler.block_size, num_blocks=cache.num_blocks,
                         allocator=allocator, blocks=cache.blocks, requests=requests,
                         num_host_blocks=cache.num_host_blocks, num_free_host_blocks=cache.num_free_host_blocks,
                         kv_cache_groups=scheduler.kv.groups)


def request_view(request: Request, scheduler: Scheduler, cache: KVCacheState) -> RequestView:
    """The request as the block map sees it; rebuilt only when the scheduler touched the request."""
    view = request.view
    if view is not None:
        return view
    first = request.seqs[0]
    if len(request.seqs) == 1 and not first.group_tables:
        view = one_sample_view(request, request.status, first.block_table, first.host_block_table,
                               len(first.token_ids), first.num_computed_tokens, request.num_cached_tokens,
                               request.num_preemptions, scheduler.block_size)
    else:
        # Several samples, or KV-cache groups (a sliding window's freed slots are neither held nor used).
        live = request.live_seqs()
        block_tables = tuple(seq.block_table for seq in live)
        host_block_tables = tuple(seq.host_block_table for seq in live if seq.host_block_table)
        # Views are built right after publishing, while the live fill is still the published version's.
        reserved, used = _shared_slots(live, scheduler.block_size, cache.live_fill)
        # Device tables only, as block_tables: a swapped request's are in the host pool.
        group_tables = tuple(seq.group_tables for seq in live) if any(seq.group_tables for seq in live) else ()
        view = RequestView(
            request.request_id, request.status, request.arrival_index, block_tables, host_block_tables,
            first.num_prompt_tokens, len(first.token_ids) - first.num_prompt_tokens, request.params.max_tokens,
            first.num_computed_tokens, request.num_cached_tokens, request.num_preemptions, request.params.n,
            reserved, used, request.prompt_preview, group_tables)
    request.view = view
    return view


def _shared_slots(live: list[Sequence], block_size: int, fill) -> tuple[int, int]:
    """(slots held in device blocks, slots holding computed tokens), counting shared blocks once."""
    blocks = list({b for seq in live for b in seq.block_table})
    return len(blocks) * block_size, int(fill[blocks].sum()) if blocks else 0


def build_stats(scheduler: Scheduler, cache: KVCacheState, step: int, now: float, batch, times: PhaseTimes,
                num_generated: int) -> StepStats:
    num_blocks = cache.num_blocks
    used = num_blocks - cache.num_free_blocks
    slots = used * scheduler.block_size
    duration = times.snapshotted - times.start
    return StepStats(
        step=step, time=now, duration=duration,
        num_prefill_tokens=batch.num_prefill_tokens, num_decode_tokens=batch.num_decode_tokens,
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped), num_free_blocks=cache.num_free_blocks,
        num_cached_free_blocks=cache.num_cached_free_blocks, num_total_blocks=num_blocks,
        kv_usage=used / num_blocks,
        kv_token_utilisation=cache.num_tokens_held / slots if slots else 0.0,
        prefix_cache_queries=cache.prefix_cache_queries, prefix_cache_hits=cache.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions, num_swapped_out_blocks=cache.num_swapped_out_blocks,
        num_swapped_in_blocks=cache.num_swapped_in_blocks,
        prompt_tokens_per_s=batch.num_prefill_tokens / duration if duration > 0 else 0.0,
        generation_tokens_per_s=num_generated / duration if duration > 0 else 0.0,
        num_generated_tokens=num_generated,
        forward_duration=times.executed - times.scheduled, num_host_blocks=cache.num_host_blocks,
        num_free_host_blocks=cache.num_free_host_blocks, schedule_duration=times.scheduled - times.start,
        num_copy_on_write_blocks=cache.num_copy_on_write_blocks, num_evicted_blocks=cache.num_evicted_blocks,
        update_duration=times.updated - times.executed, snapshot_duration=times.snapshotted - times.updated,
        group_held_blocks=cache.group_held_blocks, window_freed_blocks=cache.window_freed_blocks,
        window_freed_step=cache.window_freed_step)
