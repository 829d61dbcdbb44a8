"""When a beat stops: conditions on one step's result, run on the engine thread after each step.

A beat waits until its condition holds, so it stops at exactly the step where its moment happens. Each
condition looks only at the step's StepResult (its snapshot, events and outputs), never at the window.
"""

from __future__ import annotations

from collections.abc import Callable

from kvscope.engine.outputs import EventKind, StepResult

Condition = Callable[[StepResult], bool]


def after_steps(count: int) -> Condition:
    """Holds from the ``count``-th step of the current engine on."""
    return lambda result: result.stats.step >= count


def has_event(kind: EventKind, request_id: str | None = None) -> Condition:
    return lambda result: any(e.kind == kind and (request_id is None or e.request_id == request_id)
                              for e in result.events)


def is_running(request_id: str) -> Condition:
    return lambda result: any(v.request_id == request_id and v.queue == "running"
                              for v in result.snapshot.requests)


def has_finished(request_id: str) -> Condition:
    return lambda result: any(o.request_id == request_id and o.finished for o in result.outputs)


def all_done(result: StepResult) -> bool:
    return not result.snapshot.requests


def prefilled(request_id: str) -> Condition:
    """Holds once the request's whole prompt is computed (it has produced a token)."""
    return lambda result: any(v.request_id == request_id and v.num_output_tokens > 0
                              for v in result.snapshot.requests)


def every(*conditions: Condition) -> Condition:
    return lambda result: all(condition(result) for condition in conditions)
