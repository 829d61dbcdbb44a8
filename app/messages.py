"""Typed messages between the engine thread and the UI, and between the UI's widgets.

The engine thread only ever posts these; each carries immutable data, so the UI
can keep a reference while the engine moves on. Messages are dataclasses:
Textual's Message runs its own set-up from ``__post_init__``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from textual.message import Message

from kvscope.engine.config import EngineConfig
from kvscope.engine.outputs import CacheSnapshot, StepResult
from kvscope.engine.runner import RunnerInfo, pool_capacity


@dataclass(frozen=True)
class EngineInfo:
    """What the header shows about an engine: its runner's facts (read once after it is built) and the config
    it was built from."""

    runner: RunnerInfo
    config: EngineConfig

    @property
    def num_tokens(self) -> int:
        return pool_capacity(self.runner)[0]

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len requests fit at once (contiguous: whole reserved rows; with KV-cache groups,
        from what each group holds of one)."""
        runner = self.runner
        if self.config.allocator == "contiguous":
            blocks_per_request = -(-runner.max_model_len // runner.block_size)
            return float(runner.num_device_blocks // blocks_per_request)
        return pool_capacity(runner)[1]


@dataclass(frozen=True)
class RunState:
    """The teaching controls' state as the engine thread applies it."""

    paused: bool
    steps_per_s_cap: float | None


@dataclass
class EngineStarting(Message):
    """The engine thread started building an engine (loading a model can take a while)."""

    config: EngineConfig


@dataclass
class EngineReady(Message):
    """A new engine is built; ``log_warning`` says why the run log is off, when it is; ``run_id`` is its run's in
    the run log (None: not logged)."""

    info: EngineInfo
    banner: str
    log_warning: str | None
    run_id: int | None = None


@dataclass
class EngineStepped(Message):
    """One engine step, handed over in a StepsReady; the UI draws the newest. A step that waits behind newer ones
    may come thinned (app/worker/step_posting.py): its block changes, stats, events and the outputs the UI keeps."""

    result: StepResult


class StepBatch:
    """The steps one StepsReady hands over, in order. Closed once the UI takes them, or once the engine thread
    posts another message (the steps after it then come in a batch of their own, so nothing overtakes it)."""

    def __init__(self) -> None:
        self._steps: list[EngineStepped] = []
        self._lock = threading.Lock()     # the engine thread adds while the UI takes
        self._open = True
        self._thinned = 0       # the steps before this index are thinned

    def add(self, step: EngineStepped) -> bool:
        """Add a step; False when the batch is closed (the caller starts another)."""
        with self._lock:
            if self._open:
                self._steps.append(step)
            return self._open

    def close(self) -> None:
        with self._lock:
            self._open = False

    def thin(self, keep: int, thinned: Callable[[StepResult], StepResult]) -> None:
        """Replace the result of every step older than the newest ``keep`` that is not thinned yet with
        ``thinned(it)``."""
        with self._lock:
            steps = self._steps
            for step in steps[self._thinned:len(steps) - keep]:
                step.result = thinned(step.result)
            self._thinned = max(self._thinned, len(steps) - keep)

    def restore_newest(self, whole: Callable[[StepResult], StepResult]) -> None:
        """Replace the newest step's result with ``whole(it)`` if it was thinned (``whole`` is not called
        otherwise)."""
        with self._lock:
            if self._steps and self._thinned >= len(self._steps):
                step = self._steps[-1]
                step.result = whole(step.result)
                self._thinned = len(self._steps) - 1

    def take(self) -> list[EngineStepped]:
        with self._lock:
            self._open = False
            steps, self._steps = self._steps, []
        return steps


class StepsReady(Message):
    """Engine steps wait for the UI in ``batch``. One message stands for every step taken until the UI takes
    them: at hundreds of steps a second, posting and dispatching one message per step cost the engine and the
    UI more than handling the steps themselves."""

    def __init__(self, batch: StepBatch) -> None:
        super().__init__()
        self.batch = batch


@dataclass
class QueueChanged(Message):
    """Requests joined the queues while no step runs to show them (the engine is paused): the state now."""

    snapshot: CacheSnapshot


@dataclass
class EngineFailed(Message):
    """A step raised. The engine thread pauses and waits; the requests in flight go on after a resume."""

    error: str


@dataclass
class EngineBuildFailed(Message):
    """Building an engine raised. ``still_running`` is the engine that goes on serving (the one a
    rebuild was to replace), or None when there is none."""

    error: str
    still_running: EngineInfo | None


@dataclass
class EngineDied(Message):
    """The engine thread ended with an exception: no request runs until the app is restarted."""

    error: str


@dataclass
class RequestRejected(Message):
    """The engine thread could not add a request (add_request refused or raised), or could not give
    an accepted one its final output; the engine keeps serving the others."""

    request_id: str
    error: str


@dataclass
class CommandRejected(Message):
    """A command other than an add raised while the engine thread applied it; nothing else changed."""

    command: str
    error: str


@dataclass
class RunLogFailed(Message):
    """The run log stopped writing (a full disk, a removed file); the engine goes on without it."""

    warning: str


@dataclass
class RunUntilDone(Message):
    """A RunUntil ended at ``step``: ``met`` says whether its condition held (else it ran out of steps or work)."""

    step: int
    met: bool


@dataclass
class RunStateChanged(Message):
    """The engine thread applied a pause, resume, single step or rate cap."""

    state: RunState


@dataclass
class RequestSelected(Message):
    """The user picked a request (in the queues or the map): highlight its blocks everywhere."""

    request_id: str | None


@dataclass
class AttentionKindShown(Message):
    """The block map shows only the blocks of one attention kind (an index into group_kinds.attention_kinds),
    or every kind again (None): the legend marks which."""

    kind: int | None


@dataclass
class BlockHighlighted(Message):
    """The map's cursor or the mouse moved to a cell covering physical blocks ``first..last``."""

    first_block: int
    last_block: int


@dataclass
class ChatSubmitted(Message):
    """The user sent a chat turn; ``messages`` is the whole conversation, ending with it."""

    request_id: str
    messages: tuple[dict, ...]
    max_tokens: int


@dataclass
class PresetLaunched(Message):
    """The load generator's Send: ``count`` requests of the preset ``preset_key``."""

    preset_key: str
    count: int
