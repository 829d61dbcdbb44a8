"""When a beat stops: conditions on one step's result, run on the engine thread after each step.

A beat waits until its condition holds, so it stops at exactly the step where its moment happens. Each
condition looks only at the step's StepResult (its snapshot, events and outputs), never at the window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvscope.engine.outputs import EventKind, StepResult

Condition = Callable[[StepResult], bool]

# Each condition is a frozen dataclass or a module-level function, never a closure: the engine may run in a process
# of its own (app/worker/process.py), and a RunUntil's condition crosses to it pickled.


@dataclass(frozen=True)
class after_steps:  # noqa: N801 - read as a phrase in the lessons' beats
    """Holds from the ``count``-th step of the current engine on."""

    count: int

    def __call__(self, result: StepResult) -> bool:
        return result.stats.step >= self.count


@dataclass(frozen=True)
class has_event:  # noqa: N801
    kind: EventKind
    request_id: str | None = None

    def __call__(self, result: StepResult) -> bool:
        return any(e.kind == self.kind and (self.request_id is None or e.request_id == self.request_id)
                   for e in result.events)


@dataclass(frozen=True)
class is_running:  # noqa: N801
    request_id: str

    def __call__(self, result: StepResult) -> bool:
        return any(v.request_id == self.request_id and v.queue == "running" for v in result.snapshot.requests)


@dataclass(frozen=True)
class has_finished:  # noqa: N801
    request_id: str

    def __call__(self, result: StepResult) -> bool:
        return any(o.request_id == self.request_id and o.finished for o in result.outputs)


def all_done(result: StepResult) -> bool:
    return not result.snapshot.requests


@dataclass(frozen=True)
class prefilled:  # noqa: N801
    """Holds once the request's whole prompt is computed (it has produced a token)."""

    request_id: str

    def __call__(self, result: StepResult) -> bool:
        return any(v.request_id == self.request_id and v.num_output_tokens > 0 for v in result.snapshot.requests)


class every:  # noqa: N801
    """Holds when every one of ``conditions`` does."""

    def __init__(self, *conditions: Condition) -> None:
        self.conditions = conditions

    def __call__(self, result: StepResult) -> bool:
        return all(condition(result) for condition in self.conditions)
