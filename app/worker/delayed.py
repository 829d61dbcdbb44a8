"""Requests a preset or lesson launched for a later engine step.

Presets and lessons stagger their load ("arrives three steps later") so that a
class sees requests join a batch that is already running. Until its step comes
a delayed request is not the engine's: aborting it only drops it here, and a
rebuild forgets it with nothing to end. Requests due at the same step are added
in the order they were launched.
"""

from __future__ import annotations

import heapq
import itertools

from kvscope.app.worker.commands import AddRequest


class DelayedRequests:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, AddRequest]] = []   # (step to add at, launch order, request)
        self._launch_order = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._heap)

    def push(self, due_step: int, request: AddRequest) -> None:
        heapq.heappush(self._heap, (due_step, next(self._launch_order), request))

    def pop_due(self, step: int) -> list[AddRequest]:
        """The requests whose step has come, in launch order; they leave the queue."""
        due = []
        while self._heap and self._heap[0][0] <= step:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def drop(self, request_id: str) -> None:
        self._heap = [entry for entry in self._heap if entry[2].request_id != request_id]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()
