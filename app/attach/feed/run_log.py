"""An attached session as a run of the run log: source "vllm", one step per metrics sample.

A step's counters are the server's (running, waiting, prefix-cache tokens,
preemptions, usage), its token counts are how far the server's counters moved
since the previous sample, and its block map is the pools as the events drew
them. Its events are what the KV-cache events did since the previous sample
(blocks announced, evicted, cleared) and what the window said (restarts, lost
batches, reconnections). What vLLM does not publish is left empty (NULL), never
filled in: token utilisation and forward time. vLLM V1 recomputes preempted
requests and never swaps, so the swap columns are truly zero.

The first sample is the baseline: its step counts no tokens, since the server's
counters hold its whole life before kvscope came. The log is written as the
engine's is (app/runlog/writer.py): if it stops writing (a full disk),
``on_failure`` is told once and the window says so; a clean quit marks the run
finished.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvscope.app.attach.feed.frame import AttachFrame
from kvscope.app.attach.feed.metrics import MetricsSample
from kvscope.app.attach.feed.pool import Journal
from kvscope.app.attach.feed.pool_view import PoolView
from kvscope.app.attach.feed.rates import ServerRates
from kvscope.app.attach.feed.server import ServerInfo
from kvscope.app.runlog import open_observed_run_log
from kvscope.engine.outputs import CacheSnapshot, EngineEvent, EventKind, StepResult, StepStats

SOURCE = "vllm"


def run_config(server: ServerInfo, interval_s: float) -> dict:
    return {
        "url": server.url, "vllm_version": server.version, "model_root": server.model_root,
        "max_model_len": server.max_model_len, "num_gpu_blocks": server.num_gpu_blocks,
        "block_size": server.block_size, "engines": list(server.engines), "prefix_caching": server.prefix_caching,
        "event_sources": [source.label for source in server.event_sources], "interval_s": interval_s,
        # What the run list and History show for every run; vLLM V1 recomputes a preempted request.
        "allocator": "vLLM paged", "preemption_mode": "recompute", "enable_prefix_caching": server.prefix_caching,
    }


class AttachRunLog:
    def __init__(self, logger) -> None:
        self.logger = logger
        self._notices_logged = 0.0   # time of the newest notice already written

    @classmethod
    def open(cls, db_path: str | Path | None, server: ServerInfo, *, interval_s: float,
             enabled: bool = True, on_failure: Callable[[str], None] | None = None) -> AttachRunLog:
        ranks = max(len(server.engines), 1)
        logger = open_observed_run_log(
            db_path, source=SOURCE, model=server.model, device=f"vLLM {server.version} at {server.url}",
            dtype="not published", block_size=server.block_size, num_blocks=server.num_gpu_blocks * ranks,
            config=run_config(server, interval_s), enabled=enabled, on_failure=on_failure)
        return cls(logger)

    @property
    def warning(self) -> str | None:
        return self.logger.warning

    @property
    def run_id(self) -> int | None:
        return self.logger.run_id if self.logger.enabled else None

    def close(self) -> None:
        self.logger.close()

    def record(self, frame: AttachFrame, journals: list[tuple[str, Journal]]) -> None:
        if not self.logger.enabled or frame.stats is None:
            return
        stats = frame.stats
        events = (*journal_events(journals, frame.pools), *self._new_notices(frame))
        self.logger.step(StepResult(outputs=[], stats=stats, snapshot=merged_snapshot(frame.pools, stats.step),
                                    events=events))

    def _new_notices(self, frame: AttachFrame) -> list[EngineEvent]:
        fresh = [n for n in frame.notices if n.time > self._notices_logged]
        if fresh:
            self._notices_logged = fresh[-1].time
        return [EngineEvent(EventKind.NOTICE, None, (), n.text) for n in fresh]


def _grew(now: float, before: float | None) -> int:
    """Counter growth since the previous sample: none at the first (the baseline: what the server did
    before kvscope watched is not the session's), the whole value when the counter restarted."""
    if before is None:
        return 0
    if now < before:
        return int(now)
    return int(now - before)


def step_stats(step: int, sample: MetricsSample, previous: MetricsSample | None, rates: ServerRates | None,
               pools: tuple[PoolView, ...]) -> StepStats:
    """The sample as a step of the run log (and of the throughput panel)."""
    totals = sample.totals()
    old = previous.totals() if previous is not None else None
    num_blocks = sum(pool.num_blocks for pool in pools)
    in_use = sum(pool.num_in_use_blocks or 0 for pool in pools)
    generated = _grew(totals.generation_tokens, old.generation_tokens if old else None)
    return StepStats(
        step=step, time=sample.time, duration=sample.time - previous.time if previous else 0.0,
        num_prefill_tokens=_grew(totals.prompt_tokens, old.prompt_tokens if old else None),
        num_decode_tokens=generated, num_running=totals.num_running, num_waiting=totals.num_waiting,
        num_swapped=0, num_free_blocks=num_blocks - in_use,
        num_cached_free_blocks=sum(pool.num_cached_free_at_least for pool in pools),
        num_total_blocks=num_blocks, kv_usage=totals.kv_usage, kv_token_utilisation=None,
        prefix_cache_queries=int(totals.prefix_cache_queries), prefix_cache_hits=int(totals.prefix_cache_hits),
        num_preemptions=int(totals.num_preemptions), num_swapped_out_blocks=0, num_swapped_in_blocks=0,
        prompt_tokens_per_s=rates.prompt_tokens_per_s if rates else 0.0,
        generation_tokens_per_s=rates.generation_tokens_per_s if rates else 0.0, num_generated_tokens=generated,
        forward_duration=None)


def _offsets(pools: tuple[PoolView, ...]) -> list[int]:
    return np.cumsum([0, *(pool.num_blocks for pool in pools[:-1])]).tolist()


def journal_events(journals: list[tuple[str, Journal]], pools: tuple[PoolView, ...]) -> list[EngineEvent]:
    offsets = {pool.label: offset for pool, offset in zip(pools, _offsets(pools))}
    events = []
    for label, journal in journals:
        offset = offsets.get(label, 0)
        if journal.num_cleared:
            events.append(EngineEvent(EventKind.KV_CLEARED, None, (), f"{label}: AllBlocksCleared"))
        for kind, slots, count, verb in (
                (EventKind.KV_STORED, journal.stored_slots, journal.num_stored, "announced"),
                (EventKind.KV_REMOVED, journal.removed_slots, journal.num_removed, "evicted")):
            if count:
                named = "" if len(slots) == count else f" (the first {len(slots)} listed)"
                events.append(EngineEvent(kind, None, tuple(offset + s for s in slots),
                                          f"{label}: {count} blocks {verb}{named}"))
    return events


def merged_snapshot(pools: tuple[PoolView, ...], step: int) -> CacheSnapshot:
    """The pools side by side as one snapshot (ranks after each other), for the run log's block map."""
    if len(pools) == 1:
        return pools[0].snapshot
    offsets = _offsets(pools)
    views = []
    for pool, offset in zip(pools, offsets):
        rank = pool.label.split(" ·")[0].replace("rank ", "r")
        for view in pool.snapshot.requests:
            views.append(view._replace(request_id=f"{rank}:{view.request_id}",
                                       block_tables=tuple(tuple(offset + b for b in t) for t in view.block_tables)))
    arrays = {name: np.concatenate([getattr(pool.snapshot, name) for pool in pools])
              for name in ("block_state", "ref_counts", "block_fill", "block_hashes")}
    return CacheSnapshot(step=step, block_size=pools[0].snapshot.block_size,
                         num_blocks=sum(pool.num_blocks for pool in pools), allocator="vllm", **arrays,
                         requests=tuple(views))
