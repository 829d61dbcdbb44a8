"""What the UI may ask of the engine thread: one small frozen dataclass per command.

The UI thread never touches the engine. It sends one of these to
``EngineWorker.send``, the worker's one way in, and the engine thread applies
it between two steps, dispatching on its type with ``match``. Anything that
is not a command is refused at ``send`` with a TypeError, so a mistake fails
where it is made instead of being dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.outputs import StepResult


@dataclass(frozen=True)
class AddRequest:
    """Queue a prompt (text, token ids or chat messages); refusals come back as RequestRejected."""

    request_id: str
    prompt: Any
    params: SamplingParams


@dataclass(frozen=True)
class AddChatTurn:
    """Queue a chat turn; its max_tokens shrinks so prompt plus reply fit max_model_len and the pool."""

    request_id: str
    messages: tuple[dict, ...]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request wherever it is, or drop it before it is added if it is still scheduled."""

    request_id: str


@dataclass(frozen=True)
class SetPaused:
    paused: bool


@dataclass(frozen=True)
class StepOnce:
    """Pause (if running) and advance exactly one step."""


@dataclass(frozen=True)
class SetRateCap:
    """At most ``steps_per_s`` steps a second; None: as fast as the engine goes."""

    steps_per_s: float | None


@dataclass(frozen=True)
class LaunchPreset:
    """Send ``count`` requests of a load preset (app/load/presets.py), some of them staggered over steps."""

    key: str
    count: int


@dataclass(frozen=True)
class LaunchPlan:
    """Send the requests ``plan`` returns (app/load/presets.py's PlannedRequest, each named), planned on the engine
    thread from the running engine's PresetContext; some may be staggered over steps."""

    plan: Callable[[Any], list]


@dataclass(frozen=True)
class RunUntil:
    """Resume, and pause again after the first step for which ``condition(result)`` holds, after ``max_steps``
    steps, or when nothing is left to run; then post RunUntilDone. Evaluated on the engine thread."""

    condition: Callable[[StepResult], bool]
    max_steps: int


@dataclass(frozen=True)
class Rebuild:
    """Replace the engine with one built from ``config`` (the weights are kept when only the cache changes)."""

    config: EngineConfig


@dataclass(frozen=True)
class Stop:
    """End the engine thread; the run log is closed as finished, or as interrupted saying ``interrupted`` (why the
    app is going: the terminal closed) when given."""

    interrupted: str | None = None


@dataclass(frozen=True)
class SetRunLog:
    """Log the engines built from now on as ``spec`` says (app/runlog's RunLogSpec: the worker only calls its
    ``open(engine, on_failure)``); the engine running keeps its log."""

    spec: Any


@dataclass(frozen=True)
class RunOnEngine:
    """Run ``call`` on the engine thread between steps: the engine calls of a server in front of this engine
    (kvscope --serve: its requests' adds and aborts), which then step with everyone else's."""

    call: Callable[[], None]


# A union, so isinstance(x, WorkerCommand) checks every command at once.
WorkerCommand = (AddRequest | AddChatTurn | AbortRequest | SetPaused | StepOnce | SetRateCap | LaunchPreset
                 | LaunchPlan | RunUntil | Rebuild | Stop | RunOnEngine | SetRunLog)
