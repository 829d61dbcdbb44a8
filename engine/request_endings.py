"""How requests end other than by finishing their samples: an abort, the runner failing one request, or a step
failing part-way; and the bookkeeping every ending shares (_end, _remove).

A part of Scheduler (it inherits RequestEndings), kept apart because none of it runs in an ordinary step. It
works on the scheduler's own state: the queues and ``requests``, the KV cache manager ``kv``, the ``events``
list, and what the current schedule() pass has touched (``_scheduled``, ``_preempted``, ``_current``).
"""

from __future__ import annotations

import time
from collections import deque

from kvscope.engine.outputs import EngineEvent, EventKind, FinishReason, RequestOutput, RequestStatus
from kvscope.engine.request import Request, Sequence
from kvscope.engine.runner import RunnerOutput

_RUNNER_FAILED = "the model runner produced no token for this request (non-finite logits?)"


class RequestEndings:
    def _fail_items(self, scheduled: list[tuple[Request, Sequence, int]], runner_output: RunnerOutput, now: float,
                    outputs: list[RequestOutput]) -> set[Request]:
        """Requests the runner returned None for finish with an error; the rest of the batch goes on."""
        failed = {request for (request, _, _), sampled in zip(scheduled, runner_output) if sampled is None}
        for request in failed:
            request.error = _RUNNER_FAILED
            blocks = request.device_blocks()
            self.events.append(EngineEvent(EventKind.ERROR, request.request_id, blocks, _RUNNER_FAILED))
            self._end(request, FinishReason.ERROR, now)
            outputs.append(request.output(()))
        return failed

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request wherever it is and free its blocks: its final output, or None if it is unknown or
        already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        blocks = request.device_blocks()
        self._end(request, FinishReason.ABORT, time.time())
        self.events.append(EngineEvent(EventKind.ABORT, request_id, blocks))
        return request.output(())

    def _end(self, request: Request, reason: FinishReason, now: float) -> None:
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish(reason)
        self.kv.free_request(request)
        request.finished_time = now
        self._remove(request)

    def _remove(self, request: Request) -> None:
        status = request.status
        if status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]

    def fail_step(self, error: str) -> list[RequestOutput]:
        """The step raised part-way. Finish every request it touched (scheduled, preempted, or being worked on
        when it stopped) with FinishReason.ERROR, and rebuild the pools from the requests that go on: those
        were not touched, so they go on as if the step never ran. Spared: requests the update had already
        finished, and recompute victims, which are back in waiting with nothing in the cache to lose.
        Returns the final outputs of the touched requests that are finished now."""
        touched = [request for request, _, _ in self._scheduled] + self._preempted
        if self._current is not None:
            touched.append(self._current)
        touched = list(dict.fromkeys(touched))
        for request in touched:
            request.view = None
        failed = [r for r in touched if r.status != RequestStatus.FINISHED and not self._cleanly_requeued(r)]
        gone = set(failed)
        self.waiting = deque(r for r in self.waiting if r not in gone)
        self.running = [r for r in self.running if r not in gone]
        self.swapped = [r for r in self.swapped if r not in gone]
        now = time.time()
        for request in failed:
            self.events.append(EngineEvent(EventKind.ERROR, request.request_id, request.device_blocks(), error))
            request.error = error
            request.finished_time = now
            request.status = RequestStatus.FINISHED
            self.requests.pop(request.request_id, None)
            for seq in request.live_seqs():
                seq.finish(FinishReason.ERROR)
        self.kv.recover(keep=[seq for r in self.requests.values() for seq in r.seqs],
                        drop=[seq for r in failed for seq in r.seqs])
        self._record_cache_events(None, self.kv.take_events())  # what it cached, and dropped as half written
        self._scheduled, self._preempted, self._current = [], [], None
        return [request.output(()) for request in touched if request.status == RequestStatus.FINISHED]

    def _cleanly_requeued(self, request: Request) -> bool:
        """A recompute victim whose preemption completed: waiting, holding no blocks, nothing computed."""
        return (request.status == RequestStatus.WAITING and request in self.waiting
                and all(not seq.block_table and not seq.host_block_table and not seq.num_computed_tokens
                        for seq in request.seqs))
