"""Iteration-level scheduler: three queues, a token budget, chunked prefill and preemption.

Each step the batch is rebuilt. Fill order: running requests, oldest first,
then swapped requests coming back, then new admissions from waiting, oldest
first. A step that preempted admits nothing, and waiting requests wait while
anything is swapped out, so nobody is overtaken.

Decodes come before prefill chunks without a rule of their own: admission is
first come first served and a request is admitted only with budget to spare,
so a request still in its prompt is younger than every decoding request, and
a long prompt takes only what the decodes ahead of it leave.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import NamedTuple

from kvscope.engine.batch import BatchItem, ScheduledBatch
from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.outputs import EngineEvent
from kvscope.engine.request import Request, RequestStatus, Sequence

Plan = list[tuple[Sequence, int]]   # (sample, tokens to compute this step)
_FIRST_SAMPLE = (0,)


def _by_arrival(request: Request) -> int:
    return request.arrival_index


class SchedulerOutput(NamedTuple):
    batch: ScheduledBatch
    scheduled: list[tuple[Request, Sequence, int]]  # parallel to batch.items


class Scheduler:
    def __init__(self, config: EngineConfig, *, num_blocks: int, num_host_blocks: int, block_size: int,
                 max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.preemption_mode = config.preemption_mode
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, num_host_blocks, block_size,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 allocator=config.allocator, max_model_len=max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []    # sorted by arrival: the last one is the next victim
        self.swapped: list[Request] = []    # sorted by arrival: the first one comes back first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.num_swap_fallbacks = 0         # swap preemptions that recomputed because the host pool was full
        self.events: list[EngineEvent] = []
        # What one schedule() pass builds up: its token budget, what it scheduled and the batch items for it.
        self._budget = 0
        self._num_prefill_tokens = 0
        self._num_decode_tokens = 0
        self._scheduled: list[tuple[Request, Sequence, int]] = []
        self._items: list[BatchItem] = []

    # ---- queues ---------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish(self, request: Request) -> None:
        """Take a request out of its queue and free its blocks now, so the next step can reuse them."""
        status = request.status
        if status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self.kv.free_request(request)
        request.status = RequestStatus.FINISHED
        request.view = None
        del self.requests[request.request_id]

    def get_sequence(self, request_id: str, seq_id: int) -> Sequence:
        return next(seq for seq in self.requests[request_id].seqs if seq.seq_id == seq_id)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._budget = self.max_num_batched_tokens
        self._num_prefill_tokens = self._num_decode_tokens = 0
        scheduled = self._scheduled = []
        items = self._items = []
        preempted: list[Request] = []
        self._schedule_running(preempted)
        if not preempted:
            self._schedule_swapped()
            if not self.swapped:
                self._schedule_waiting()
        swap_out, swap_in, copies = self.kv.take_cache_moves()
        batch = ScheduledBatch(items=tuple(items), blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in,
                               blocks_to_copy=copies, num_prefill_tokens=self._num_prefill_tokens,
                               num_decode_tokens=self._num_decode_tokens,
                               preempted_request_ids=tuple(r.request_id for r in preempted))
        return SchedulerOutput(batch, scheduled)

    def _schedule_running(self, preempted: list[Request]) -> None:
        running = self.running
        index = 0
        while index < len(running) and self._budget > 0:
            request = running[index]
            index += 1
            if self._schedule_decode(request):
                continue
            plan = self._plan(request)
            while not self.kv.allocate_slots(request, plan):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    return  # it was the most recent arrival left, so nobody is behind it
            self._take(request, plan)

    def _schedule_decode(self, request: Request) -> bool:
        """The step's common case, without building a plan: one sample decoding one token.

        False, changing nothing, for anything else (a prefill chunk, n > 1, no free block for the
        token), which the general path then handles.
        """
        seqs = request.seqs
        if len(seqs) != 1:
            return False
        seq = seqs[0]
        start = seq.num_computed_tokens
        token_ids = seq.token_ids
        if len(token_ids) - start != 1 or not self.kv.append_slot(seq):
            return False
        self._scheduled.append((request, seq, 1))
        # Positional, and built here rather than in a second pass: this runs for every request every step.
        self._items.append(BatchItem(seq.seq_id, request.request_id, (token_ids[start],), start, seq.table_tuple(),
                               _FIRST_SAMPLE, request.params))
        if start >= seq.num_prompt_tokens:
            self._num_decode_tokens += 1
        else:
            self._num_prefill_tokens += 1   # a prompt's last token, alone in its chunk
        self._budget -= 1
        request.view = None
        if self.kv.block_pool.evicted:
            self._record_evictions(request)
        return True

    def _schedule_swapped(self) -> None:
        while self.swapped and self._budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            plan = self._plan(request)
            if not self.kv.swap_in(request, plan):
                return
            self.swapped.pop(0)
            self._enter_running(request)
            blocks = tuple(b for seq in request.seqs for b in seq.block_table)
            self.events.append(EngineEvent("swap_in", request.request_id, blocks))
            self._take(request, plan)

    def _schedule_waiting(self) -> None:
        bs = self.block_size
        while self.waiting and self._budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits = {seq.index: self.kv.find_cached_prefix(seq) for seq in request.schedulable_seqs()}
            plan: Plan = []
            budget = self._budget
            for seq in request.schedulable_seqs():
                take = min(seq.num_tokens - len(hits[seq.index]) * bs, budget)
                if take <= 0:
                    break
                plan.append((seq, take))
                budget -= take
            if not self.kv.allocate_for_admission(request, plan, hits):
                return
            self.waiting.popleft()
            if not request.admitted:
                request.admitted = True
                request.num_cached_tokens = request.seqs[0].num_computed_tokens
            self._enter_running(request)
            self._take(request, plan)

    def _plan(self, request: Request) -> Plan:
        """Tokens per sample this step: a decode, or as much of the remaining prompt as the budget allows."""
        budget = self._budget
        plan = []
        for seq in request.schedulable_seqs():
            take = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if take <= 0:
                break
            plan.append((seq, take))
            budget -= take
        return plan

    def _take(self, request: Request, plan: Plan) -> None:
        for seq, num_new in plan:
            self._scheduled.append((request, seq, num_new))
            self._items.append(self._item(request, seq, num_new))
            self._budget -= num_new
        request.view = None
        if self.kv.block_pool.evicted:
            self._record_evictions(request)

    def _item(self, request: Request, seq: Sequence, num_new: int) -> BatchItem:
        start = seq.num_computed_tokens
        end = start + num_new
        if end < seq.num_tokens:
            samples: tuple[int, ...] = ()
        elif request.forked:
            samples = (seq.index,)
        else:
            samples = tuple(range(request.params.n))    # the prompt completes: every sample draws
        if num_new == 1 and start >= seq.num_prompt_tokens:
            self._num_decode_tokens += 1
        else:
            self._num_prefill_tokens += num_new
        return BatchItem(seq.seq_id, request.request_id, tuple(seq.token_ids[start:end]), start, seq.table_tuple(),
                         samples, request.params)

    def _record_evictions(self, request: Request) -> None:
        evicted = self.kv.block_pool.drain_evicted()
        self.events.append(EngineEvent("evict", request.request_id, tuple(evicted)))

    def _enter_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.view = None
        bisect.insort(self.running, request, key=_by_arrival)

    def _preempt(self, victim: Request) -> None:
        victim.num_preemptions += 1
        self.num_preemptions += 1
        victim.view = None
        blocks = tuple(b for seq in victim.seqs for b in seq.block_table)
        if self.preemption_mode == "swap" and self.kv.swap_out(victim):
            victim.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, victim, key=_by_arrival)
            self.events.append(EngineEvent("preempt", victim.request_id, blocks, "swap"))
            self.events.append(EngineEvent("swap_out", victim.request_id, blocks))
            return
        detail = "recompute"
        if self.preemption_mode == "swap":
            self.num_swap_fallbacks += 1
            detail = "recompute (host pool full)"
        self.kv.free_request(victim)
        for seq in victim.seqs:
            seq.num_computed_tokens = 0     # generated tokens stay: it resumes where it was
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.events.append(EngineEvent("preempt", victim.request_id, blocks, detail))
