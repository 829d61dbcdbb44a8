"""Typed messages between the engine thread and the UI, and between the UI's widgets.

The engine thread only ever posts these; each carries immutable data, so the UI
can keep a reference while the engine moves on.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from kvscope.engine.config import EngineConfig
from kvscope.engine.outputs import StepResult


@dataclass(frozen=True)
class EngineInfo:
    """What the header shows about an engine, read once after it is built."""

    model_name: str
    device: str
    dtype: str
    block_size: int
    num_blocks: int
    num_host_blocks: int
    max_model_len: int
    kv_cache_bytes: int | None
    config: EngineConfig

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len requests fit at once (contiguous: whole reserved rows)."""
        if self.config.allocator == "contiguous":
            blocks_per_request = -(-self.max_model_len // self.block_size)
            return float(self.num_blocks // blocks_per_request)
        return self.num_tokens / self.max_model_len


@dataclass(frozen=True)
class RunState:
    """The teaching controls' state as the engine thread applies it."""

    paused: bool
    steps_per_s_cap: float | None


class EngineStarting(Message):
    """The engine thread started building an engine (loading a model can take a while)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config


class EngineReady(Message):
    """A new engine is built; ``log_warning`` says why the run log is off, when it is."""

    def __init__(self, info: EngineInfo, banner: str, log_warning: str | None) -> None:
        super().__init__()
        self.info = info
        self.banner = banner
        self.log_warning = log_warning


class EngineStepped(Message):
    """One engine step. Posted once per step; the UI draws the newest and keeps every output."""

    def __init__(self, result: StepResult) -> None:
        super().__init__()
        self.result = result


class EngineFailed(Message):
    """Building the engine or running a step raised. The engine thread pauses and waits."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class RequestRejected(Message):
    """add_request refused a request (RequestError); the engine keeps serving the others."""

    def __init__(self, request_id: str, error: str) -> None:
        super().__init__()
        self.request_id = request_id
        self.error = error


class RunStateChanged(Message):
    def __init__(self, state: RunState) -> None:
        super().__init__()
        self.state = state


class RequestSelected(Message):
    """The user picked a request (in the queues or the map): highlight its blocks everywhere."""

    def __init__(self, request_id: str | None) -> None:
        super().__init__()
        self.request_id = request_id


class BlockHighlighted(Message):
    """The map's cursor or the mouse moved to a cell covering physical blocks ``first..last``."""

    def __init__(self, first_block: int, last_block: int) -> None:
        super().__init__()
        self.first_block = first_block
        self.last_block = last_block


class ChatSubmitted(Message):
    """The user sent a chat turn; ``messages`` is the whole conversation, ending with it."""

    def __init__(self, request_id: str, messages: tuple[dict, ...], max_tokens: int) -> None:
        super().__init__()
        self.request_id = request_id
        self.messages = messages
        self.max_tokens = max_tokens


class PresetLaunched(Message):
    def __init__(self, preset_key: str, count: int) -> None:
        super().__init__()
        self.preset_key = preset_key
        self.count = count
