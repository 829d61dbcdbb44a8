"""Iteration-level scheduler: three queues, a token budget, chunked prefill, preemption, and each step's
bookkeeping. It owns every change to requests and blocks: a step is schedule() → the runner's execute()
→ update_from_output(), as in vLLM V1; abort() and fail_step() are the only other ways a request ends
(engine/request_endings.py, a part of the Scheduler class).

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
import time
from collections import deque
from typing import NamedTuple

from kvscope.engine.batch import BatchItem, ScheduledBatch
from kvscope.engine.config import EngineConfig
from kvscope.engine.hybrid_kv_cache_manager import make_kv_cache_manager
from kvscope.engine.kv_cache_groups import KVCacheGroup
from kvscope.engine.kv_cache_manager import CopyOnWrite, KVCacheState
from kvscope.engine.outputs import BlockRemoved, EngineEvent, EventKind, KVCacheEvent, RequestOutput, RequestStatus
from kvscope.engine.request import Request, Sequence
from kvscope.engine.request_endings import RequestEndings
from kvscope.engine.runner import RunnerOutput

Plan = list[tuple[Sequence, int]]   # (sample, tokens to compute this step)
_FIRST_SAMPLE = (0,)
_new_tuple = tuple.__new__


def _by_arrival(request: Request) -> int:
    return request.arrival_index


class SchedulerOutput(NamedTuple):
    batch: ScheduledBatch
    scheduled: list[tuple[Request, Sequence, int]]  # parallel to batch.items: (request, sample, tokens computed)
    preempted: list[Request]


class StepEvents(NamedTuple):
    """What a step reports beyond its outputs: the scheduler's events, and the prefix cache's changes."""

    events: tuple[EngineEvent, ...]
    kv_events: tuple[KVCacheEvent, ...]


class StepUpdate(NamedTuple):
    """What update_from_output reports, as vLLM's EngineCoreOutputs: an output for each request with something
    to report, in output order, how many tokens the step generated, and the outputs of the requests that
    finished, in the same order."""

    outputs: list[RequestOutput]
    num_generated: int
    finished: list[RequestOutput]


class Scheduler(RequestEndings):
    def __init__(self, config: EngineConfig, *, num_blocks: int, num_host_blocks: int, block_size: int,
                 max_model_len: int, kv_cache_groups: tuple[KVCacheGroup, ...] = ()) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.preemption_mode = config.preemption_mode
        self.block_size = block_size
        self.kv = make_kv_cache_manager(config, num_blocks, num_host_blocks, block_size, max_model_len,
                                        kv_cache_groups)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []    # sorted by arrival: the last one is the next victim
        self.swapped: list[Request] = []    # sorted by arrival: the first one comes back first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.events: list[EngineEvent] = []
        self.kv_events: list[KVCacheEvent] = []
        # What one schedule() pass builds up: its token budget, what it scheduled and the batch items for it,
        # what it preempted, and the request it is working on (what a failed step has touched: fail_step).
        self._budget = 0
        self._num_prefill_tokens = 0
        self._num_decode_tokens = 0
        self._scheduled: list[tuple[Request, Sequence, int]] = []
        self._items: list[BatchItem] = []
        self._preempted: list[Request] = []
        self._current: Request | None = None

    # ---- queues ---------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_sequence(self, request_id: str, seq_id: int) -> Sequence:
        return next(seq for seq in self.requests[request_id].seqs if seq.seq_id == seq_id)

    def max_blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int) -> int:
        return self.kv.max_blocks_needed(num_prompt_tokens, max_tokens, n)

    def max_request_tokens(self, n: int) -> int:
        return self.kv.max_request_tokens(n)

    def take_events(self) -> StepEvents:
        """Everything to report since the last call, leaving nothing queued."""
        self._record_cache_events(None, self.kv.take_events())
        taken = StepEvents(tuple(self.events), tuple(self.kv_events))
        self.events.clear()
        self.kv_events.clear()
        return taken

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def cache_state(self, advance: bool = True) -> KVCacheState:
        """The KV cache's state published for a snapshot and its stats (KVCacheManager.copy_state)."""
        return self.kv.copy_state(advance)

    # ---- one step: schedule -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._budget = self.max_num_batched_tokens
        self._num_prefill_tokens = self._num_decode_tokens = 0
        scheduled = self._scheduled = []
        items = self._items = []
        preempted = self._preempted = []
        self._schedule_running()
        if not preempted:
            self._schedule_swapped()
            if not self.swapped:
                self._schedule_waiting()
        self._current = None
        swap_out, swap_in, copies = self.kv.take_cache_moves()
        batch = ScheduledBatch(items=tuple(items), blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in,
                               blocks_to_copy=copies, num_prefill_tokens=self._num_prefill_tokens,
                               num_decode_tokens=self._num_decode_tokens,
                               preempted_request_ids=tuple(r.request_id for r in preempted))
        return SchedulerOutput(batch, scheduled, preempted)

    def _schedule_running(self) -> None:
        running = self.running
        index = self._schedule_decodes(0)
        while index < len(running) and self._budget > 0:
            request = self._current = running[index]
            index += 1
            plan = self._plan(request)
            while not self.kv.allocate_slots(request, plan):
                victim = running.pop()
                self._preempted.append(victim)
                self._preempt(victim)
                if victim is request:
                    return  # it was the most recent arrival left, so nobody is behind it
            self._take(request, plan)
            index = self._schedule_decodes(index)

    def _schedule_decodes(self, index: int) -> int:
        """Schedule running requests from ``running[index]`` on while they are the step's common case, one sample
        decoding one token, without building plans; the index of the first one that is not (a prefill chunk,
        n > 1, no free block for the token: the general path's), or of the end, or where the budget ran out.

        One loop over local names: this runs for every request every step.
        """
        running, kv, block_size = self.running, self.kv, self.block_size
        every_token = kv.slot_work_inside_blocks
        scheduled, items = self._scheduled, self._items
        budget, num_decode, num_prompt_ends = self._budget, 0, 0
        while index < len(running) and budget > 0:
            request = running[index]
            seqs = request.seqs
            if len(seqs) != 1:
                break
            seq = seqs[0]
            start = seq.num_computed_tokens
            token_ids = seq.token_ids
            if len(token_ids) - start != 1:
                break
            table = seq.block_table
            # Inside a block the sample's table already holds the token's slot (its previous token is in the same
            # block): the KV cache manager is asked only at a block's first slot, unless it works at every token.
            if not start % block_size or every_token:
                self._current = request
                if not kv.append_slot(seq):
                    break
            index += 1
            budget -= 1
            scheduled.append((request, seq, 1))
            # BatchItem's fields in order, through tuple.__new__: its own constructor costs twice as much.
            items.append(_new_tuple(BatchItem, (seq.seq_id, request.request_id, (token_ids[start],), start,
                                                seq.block_table, _FIRST_SAMPLE, request.params, seq.group_tables,
                                                request.sampling)))
            if start >= seq.num_prompt_tokens:
                num_decode += 1
            else:
                num_prompt_ends += 1    # a prompt's last token, alone in its chunk
            if seq.block_table is not table:    # it took a block, which may have evicted a cached prefix
                self._record_cache_events(request, kv.take_events())
        self._budget = budget
        self._num_decode_tokens += num_decode
        self._num_prefill_tokens += num_prompt_ends
        return index

    def _schedule_swapped(self) -> None:
        while self.swapped and self._budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._current = self.swapped[0]
            plan = self._plan(request)
            if not self.kv.swap_in(request, plan):
                return
            self.swapped.pop(0)
            self._enter_running(request)
            self.events.append(EngineEvent(EventKind.SWAP_IN, request.request_id, request.device_blocks()))
            self._take(request, plan)

    def _schedule_waiting(self) -> None:
        bs = self.block_size
        while self.waiting and self._budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._current = self.waiting[0]
            hits = {seq.index: self.kv.find_cached_prefix(seq) if request.reads_prefix_cache else []
                    for seq in request.schedulable_seqs()}
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
            for seq, _ in plan:
                seq.num_computed_tokens = len(hits[seq.index]) * bs
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
        cache_events = self.kv.take_events()
        if cache_events:
            self._record_cache_events(request, cache_events)

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
        return BatchItem(seq.seq_id, request.request_id, tuple(seq.token_ids[start:end]), start, seq.block_table,
                         samples, request.params, seq.group_tables, request.sampling)

    def _record_cache_events(self, request: Request | None, cache_events) -> None:
        """Report what the KV cache manager did: its KV-cache events as they are, and as events the blocks
        that ``request``'s allocation evicted and copied (None: no allocation, so a removal is no eviction)."""
        request_id = request.request_id if request is not None else None
        evicted = []
        copies = []
        for event in cache_events:
            kind = type(event)
            if kind is CopyOnWrite:
                copies.append(EngineEvent(EventKind.COPY_ON_WRITE, request_id, (event.src, event.dst),
                                          f"sample {event.sample_index}"))
                continue
            self.kv_events.append(event)
            if kind is BlockRemoved and request is not None:
                evicted.append(event.block_id)
        if evicted:
            self.events.append(EngineEvent(EventKind.EVICT, request_id, tuple(evicted)))
        self.events.extend(copies)

    def _enter_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:    # vLLM's queue time ends here, and its prefill time starts
            request.first_scheduled_time = time.time()
        bisect.insort(self.running, request, key=_by_arrival)

    def _preempt(self, victim: Request) -> None:
        victim.num_preemptions += 1
        self.num_preemptions += 1
        blocks = victim.device_blocks()
        if self.preemption_mode == "swap" and self.kv.swap_out(victim):
            victim.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, victim, key=_by_arrival)
            self.events.append(EngineEvent(EventKind.PREEMPT, victim.request_id, blocks, "swap"))
            self.events.append(EngineEvent(EventKind.SWAP_OUT, victim.request_id, blocks))
            return
        detail = "recompute"
        if self.preemption_mode == "swap":
            detail = "recompute (host pool full)"
        self.kv.free_request(victim)
        for seq in victim.seqs:
            seq.num_computed_tokens = 0     # generated tokens stay: it resumes where it was
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.events.append(EngineEvent(EventKind.PREEMPT, victim.request_id, blocks, detail))

    # ---- one step: update from the runner's output --------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, runner_output: RunnerOutput) -> StepUpdate:
        """Record what the runner computed and sampled: commit computed tokens (filling blocks, caching full
        ones), fork the samples of n > 1 requests whose prompt completed, append each sampled token, apply
        the stop rules, finish and free the requests that are done, and build the outputs. Drops the snapshot
        view of every request the step scheduled or preempted: no other request changed."""
        now = time.time()
        outputs: list[RequestOutput] = []
        failed = self._fail_items(output.scheduled, runner_output, now, outputs) if None in runner_output else ()
        finished = outputs[:]   # the failed ones: every output so far
        grouped: dict[Request, int | None] = {}   # n > 1 requests that sampled, with sample 0's token
        commit = self.kv.commit
        num_generated = 0
        for (request, seq, num_new), item, sampled in zip(output.scheduled, output.batch.items, runner_output,
                                                          strict=True):
            request.view = None
            if failed and request in failed:
                continue
            start = item.start_pos
            commit(seq, start, num_new)
            seq.num_computed_tokens = start + num_new
            sample_indices = item.sample_indices
            if not sample_indices:
                continue    # mid-prefill
            num_generated += len(sampled)
            if len(request.seqs) == 1:
                token = sampled[0]
                ended = request.append_token(seq, token, now)
                if ended:
                    self._sample_finished(request, seq, now)
                reply = request.output((token,))
                outputs.append(reply)
                if ended:   # its one sample, and the request with it
                    finished.append(reply)
                continue
            if not request.forked:
                self._fork(request)
            grouped.setdefault(request, None)
            for sample_index, token in zip(sample_indices, sampled):
                sample = request.seqs[sample_index]
                if request.append_token(sample, token, now):
                    self._sample_finished(request, sample, now)
                if sample_index == 0:
                    grouped[request] = token
        for request, token in grouped.items():
            reply = request.output(() if token is None else (token,))
            outputs.append(reply)
            if reply.finished:
                finished.append(reply)
        for request in output.preempted:
            request.view = None
        return StepUpdate(outputs, num_generated, finished)

    def _fork(self, request: Request) -> None:
        parent = request.seqs[0]
        for child in request.seqs[1:]:
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.fork(parent, child)
        request.forked = True

    def _sample_finished(self, request: Request, seq: Sequence, now: float) -> None:
        """Free a finished sample's blocks now, so the next step can reuse them; the last one ends the request."""
        blocks = seq.block_table
        self.kv.free_sequence(seq)
        if any(s.finish_reason is None for s in request.seqs):
            return
        request.finished_time = now
        self._remove(request)
        self.events.append(EngineEvent(EventKind.FINISH, request.request_id, blocks, seq.finish_reason))
