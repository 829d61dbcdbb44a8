"""What the UI may ask of the engine thread: one small frozen dataclass per command.

The UI thread never touches the engine. It sends one of these to
``EngineWorker.send`` (or calls the worker's method of the same meaning), and
the engine thread applies it between two steps, dispatching on its type with
``match``. Anything that is not a command is refused at ``send`` with a
TypeError, so a mistake fails where it is made instead of being dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscope.engine.config import EngineConfig, SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Queue a prompt (text, token ids or chat messages); refusals come back as RequestRejected."""

    request_id: str
    prompt: Any
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
    """Send ``count`` requests of a load preset (app/presets.py), some of them staggered over steps."""

    key: str
    count: int


@dataclass(frozen=True)
class Rebuild:
    """Replace the engine with one built from ``config`` (the weights are kept when only the cache changes)."""

    config: EngineConfig


@dataclass(frozen=True)
class Stop:
    """End the engine thread; the run log is closed as finished."""


# A union, so isinstance(x, WorkerCommand) checks every command at once.
WorkerCommand = AddRequest | AbortRequest | SetPaused | StepOnce | SetRateCap | LaunchPreset | Rebuild | Stop
