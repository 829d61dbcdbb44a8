"""A synthetic engine for the run-log tests: realistic, changing StepResults without a model.

It allocates paged KV blocks the way the real engine does (prefix-shared blocks
with ref counts, cached-free blocks kept until evicted, one new block every
block_size decode tokens, preemption when the pool runs dry), so snapshot sizes
and replays are measured on data that changes like the real thing. Its own
bookkeeping is checked in tests/app/runlog/test_runlog_synthetic.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvscope.engine.outputs import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_USED,
    CacheSnapshot,
    EngineEvent,
    RequestMetrics,
    RequestOutput,
    RequestView,
    SampleOutput,
    StepResult,
    StepStats,
)


@dataclass
class _Request:
    request_id: str
    arrival_index: int
    prompt_len: int
    max_tokens: int
    prefix_group: int
    arrival_time: float
    queue: str = "waiting"
    blocks: list[int] = field(default_factory=list)
    num_output: int = 0
    num_computed: int = 0
    num_cached: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()


class SyntheticEngine:
    """Paged-KV bookkeeping with fake tokens. ``step()`` returns a StepResult like LLMEngine's."""

    def __init__(self, num_blocks: int, *, block_size: int = 16, max_running: int = 64,
                 arrivals_per_step: float = 0.5, seed: int = 0):
        self.num_blocks, self.block_size, self.max_running = num_blocks, block_size, max_running
        self.arrivals_per_step = arrivals_per_step
        self.rng = np.random.default_rng(seed)
        self.state = np.zeros(num_blocks, np.int8)
        self.refs = np.zeros(num_blocks, np.int32)
        self.fill = np.zeros(num_blocks, np.int16)
        self.hashes = np.zeros(num_blocks, np.uint64)
        self.cached_lru: dict[int, None] = {}        # cached-free blocks, oldest first
        self.cached_by_hash: dict[int, int] = {}
        self.requests: dict[str, _Request] = {}
        self.step_index = 0
        self.num_arrivals = 0
        self.num_preemptions = 0
        self.prefix_queries = self.prefix_hits = 0

    # --- blocks ----------------------------------------------------------------------

    def _block_hash(self, req: _Request, index: int) -> int:
        if index < 4:  # the first four blocks of a prompt group are a shared system prompt
            return 1_000_003 * (req.prefix_group + 1) + index
        return (hash((req.request_id, index)) & 0x7FFF_FFFF_FFFF_FFFF) | 1

    def _num_free(self) -> int:
        return int((self.refs == 0).sum())

    def _allocate(self, events: list[EngineEvent], req: _Request) -> int | None:
        empty = np.flatnonzero(self.state == BLOCK_FREE)
        if empty.size:
            block = int(empty[0])
        elif self.cached_lru:
            block = next(iter(self.cached_lru))
            del self.cached_lru[block]
            del self.cached_by_hash[int(self.hashes[block])]
            self.hashes[block] = 0
            events.append(EngineEvent("evict", req.request_id, (block,)))
        else:
            return None
        self.state[block], self.refs[block], self.fill[block] = BLOCK_USED, 1, 0
        return block

    def _release(self, req: _Request) -> None:
        for block in req.blocks:
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            if self.hashes[block]:
                self.state[block] = BLOCK_CACHED
                self.cached_lru[block] = None
            else:
                self.state[block], self.fill[block] = BLOCK_FREE, 0
        req.blocks = []

    def _admit(self, req: _Request, events: list[EngineEvent]) -> bool:
        needed = -(-(req.prompt_len + req.num_output + 1) // self.block_size)
        if needed > self._num_free():
            return False
        tokens = req.prompt_len + req.num_output
        for index in range(needed):
            digest = self._block_hash(req, index)
            full = (index + 1) * self.block_size <= tokens
            self.prefix_queries += self.block_size if full else 0
            shared = self.cached_by_hash.get(digest) if full else None
            if shared is not None:
                self.cached_lru.pop(shared, None)
                self.refs[shared] += 1
                self.state[shared] = BLOCK_USED
                req.blocks.append(shared)
                req.num_cached += self.block_size
                self.prefix_hits += self.block_size
                continue
            block = self._allocate(events, req)
            filled = min(self.block_size, tokens - index * self.block_size)
            self.fill[block] = filled
            if full:
                self.hashes[block] = digest
                self.cached_by_hash[digest] = block
            req.blocks.append(block)
        req.queue, req.num_computed = "running", tokens
        return True

    # --- steps -----------------------------------------------------------------------

    def add_request(self) -> str:
        request_id = f"req-{self.num_arrivals}"
        self.requests[request_id] = _Request(
            request_id, self.num_arrivals, prompt_len=int(self.rng.integers(32, 400)),
            max_tokens=int(self.rng.integers(16, 256)), prefix_group=int(self.rng.integers(0, 3)),
            arrival_time=time.time())
        self.num_arrivals += 1
        return request_id

    def step(self) -> StepResult:
        start = time.time()
        events: list[EngineEvent] = []
        for _ in range(self.rng.poisson(self.arrivals_per_step)):
            self.add_request()
        running = [r for r in self.requests.values() if r.queue == "running"]
        prefill_tokens = 0
        for req in (r for r in self.requests.values() if r.queue == "waiting"):
            if len(running) >= self.max_running or not self._admit(req, events):
                break
            prefill_tokens += req.num_computed - req.num_cached
            running.append(req)
        decoded = self._decode(running, events)
        now = time.time()
        outputs = [self._output(r, now) for r in decoded]
        for req in decoded:
            if req.num_output >= req.max_tokens:
                self._release(req)
                del self.requests[req.request_id]
        self.step_index += 1
        return StepResult(outputs, self._stats(start, prefill_tokens, len(decoded)), self.snapshot(),
                          tuple(events))

    def _decode(self, running: list[_Request], events: list[EngineEvent]) -> list[_Request]:
        decoded = []
        for req in running:
            if req.queue != "running":
                continue  # preempted earlier in this step
            position = req.prompt_len + req.num_output
            if position % self.block_size == 0:
                block = self._allocate(events, req)
                while block is None:
                    victim = max((r for r in running if r.queue == "running"), key=lambda r: r.arrival_index)
                    self._release(victim)
                    victim.queue, victim.num_computed = "waiting", 0
                    victim.num_preemptions += 1
                    self.num_preemptions += 1
                    events.append(EngineEvent("preempt", victim.request_id))
                    if victim is req:
                        break
                    block = self._allocate(events, req)
                if req.queue != "running":
                    continue
                req.blocks.append(block)
            last = req.blocks[-1]
            self.fill[last] = position % self.block_size + 1
            req.num_output += 1
            req.num_computed = position + 1
            decoded.append(req)
        return decoded

    def _output(self, req: _Request, now: float) -> RequestOutput:
        req.first_token_time = req.first_token_time or now
        req.prompt_ids = req.prompt_ids or tuple(range(req.prompt_len))
        req.output_ids = tokens = req.output_ids + (req.num_output,)
        finished = req.num_output >= req.max_tokens
        reason = "length" if finished else None
        text = " ".join(map(str, tokens[-3:]))
        return RequestOutput(
            req.request_id, tuple(range(req.prompt_len)), tokens[-1:], f" {tokens[-1]}", tokens, text,
            finished, reason, req.num_cached, req.num_preemptions,
            RequestMetrics(req.arrival_time, req.arrival_time, req.first_token_time,
                           now if finished else None),
            (SampleOutput(0, tokens, text, reason),))

    def _stats(self, start: float, prefill_tokens: int, decode_tokens: int) -> StepStats:
        now = time.time()
        duration = max(now - start, 1e-6)
        counts = {q: sum(r.queue == q for r in self.requests.values()) for q in ("running", "waiting")}
        num_free = self._num_free()
        used = self.refs > 0
        return StepStats(
            step=self.step_index - 1, time=now, duration=duration, num_prefill_tokens=prefill_tokens,
            num_decode_tokens=decode_tokens, num_running=counts["running"], num_waiting=counts["waiting"],
            num_swapped=0, num_free_blocks=num_free, num_cached_free_blocks=len(self.cached_lru),
            num_total_blocks=self.num_blocks, kv_usage=1 - num_free / self.num_blocks,
            kv_token_utilisation=float(self.fill[used].sum()) / max(1, used.sum() * self.block_size),
            prefix_cache_queries=self.prefix_queries, prefix_cache_hits=self.prefix_hits,
            num_preemptions=self.num_preemptions, num_swapped_out_blocks=0, num_swapped_in_blocks=0,
            prompt_tokens_per_s=prefill_tokens / duration, generation_tokens_per_s=decode_tokens / duration,
            num_generated_tokens=decode_tokens,
        )

    def snapshot(self) -> CacheSnapshot:
        views = tuple(
            RequestView(
                request_id=r.request_id, queue=r.queue, arrival_index=r.arrival_index,
                block_tables=(tuple(r.blocks),), host_block_tables=((),), num_prompt_tokens=r.prompt_len,
                num_output_tokens=r.num_output, max_tokens=r.max_tokens, num_computed_tokens=r.num_computed,
                num_cached_tokens=r.num_cached, num_preemptions=r.num_preemptions, num_samples=1,
                reserved_slots=len(r.blocks) * self.block_size, used_slots=r.num_computed,
                prompt_preview=f"prompt {r.arrival_index} of group {r.prefix_group}")
            for r in self.requests.values()
        )
        arrays = [a.copy() for a in (self.state, self.refs, self.fill, self.hashes)]
        for array in arrays:
            array.flags.writeable = False
        return CacheSnapshot(self.step_index - 1, self.block_size, self.num_blocks, "paged", *arrays, views)
