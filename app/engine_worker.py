"""The engine thread: owns the LLMEngine, takes commands from a queue, posts one message per step.

Everything the UI asks for (add, abort, pause, single step, rate cap, preset,
rebuild) goes through ``commands`` and is applied between steps, so the engine
is only ever touched by this thread. Results go back with ``post_message``,
which never waits for the UI; a semaphore bounds how far the engine may run
ahead of a UI that has stopped draining messages.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvscope.app import presets
from kvscope.app.messages import (
    EngineFailed,
    EngineInfo,
    EngineReady,
    EngineStarting,
    EngineStepped,
    RequestRejected,
    RunState,
    RunStateChanged,
)
from kvscope.engine.config import EngineConfig, RequestError, SamplingParams
from kvscope.engine.outputs import StepResult

MAX_STEPS_AHEAD_OF_UI = 256


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    prompt_text: str


@dataclass(frozen=True)
class _Command:
    name: str
    value: Any = None


def build_engine(config: EngineConfig, previous=None):
    """A new LLMEngine; reuses the previous engine's weights when only the cache settings changed."""
    from kvscope.engine import LLMEngine

    model = getattr(getattr(previous, "runner", None), "model", None)
    if model is not None and previous.config.model == config.model and previous.config.dtype == config.dtype:
        return LLMEngine(config, model=model, tokenizer=previous.tokenizer)
    return LLMEngine(config)


def engine_info(engine) -> EngineInfo:
    """Header facts, read defensively: a stand-in runner may not have every attribute."""
    runner = engine.runner
    config = engine.config
    return EngineInfo(
        model_name=str(getattr(runner, "model_name", config.model)),
        device=str(getattr(runner, "device", config.device)),
        dtype=str(getattr(runner, "dtype", config.dtype)).removeprefix("torch."),
        block_size=int(getattr(runner, "block_size", config.block_size)),
        num_blocks=int(runner.num_device_blocks),
        num_host_blocks=int(getattr(runner, "num_host_blocks", 0)),
        max_model_len=int(runner.max_model_len),
        kv_cache_bytes=getattr(runner, "kv_cache_bytes", None),
        config=config,
    )


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], dict):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)
    return " ".join(str(t) for t in prompt)


class EngineWorker:
    """``run`` is the thread body (the app starts it as a thread worker); every other method is for the UI."""

    def __init__(self, target, config: EngineConfig, *, engine_factory: Callable = build_engine,
                 log_factory: Callable[[EngineConfig, EngineInfo], Any] | None = None,
                 paused: bool = False, steps_per_s_cap: float | None = None) -> None:
        self.target = target
        self.config = config
        self.engine = None
        self.info: EngineInfo | None = None
        self._engine_factory = engine_factory
        self._log_factory = log_factory
        self._logger = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = threading.BoundedSemaphore(MAX_STEPS_AHEAD_OF_UI)
        self._paused = paused
        self._steps_per_s_cap = steps_per_s_cap
        self._pending_steps = 0
        self._abort_unreported = False
        self._next_step_at = 0.0
        self._scheduled: list[tuple[int, int, _Add]] = []  # (engine step to add at, order, request)
        self._unlogged: dict[str, tuple[str, int]] = {}
        self._ids = itertools.count()
        self._steps_done = 0
        self._stopping = threading.Event()

    # --- the UI's side: every call only queues a command --------------------------------

    def submit(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        self._commands.put(_Add(request_id, prompt, params, _prompt_text(prompt)))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Command("abort", request_id))

    def pause(self) -> None:
        self._commands.put(_Command("pause"))

    def resume(self) -> None:
        self._commands.put(_Command("resume"))

    def step_once(self) -> None:
        """Pause (if running) and advance exactly one step."""
        self._commands.put(_Command("step"))

    def set_rate_cap(self, steps_per_s: float | None) -> None:
        self._commands.put(_Command("rate", steps_per_s))

    def launch_preset(self, key: str, count: int) -> None:
        self._commands.put(_Command("preset", (key, count)))

    def rebuild(self, config: EngineConfig) -> None:
        self._commands.put(_Command("rebuild", config))

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(_Command("stop"))

    def ack(self) -> None:
        """The UI handled one EngineStepped message."""
        try:
            self._in_flight.release()
        except ValueError:
            pass

    @property
    def state(self) -> RunState:
        return RunState(self._paused, self._steps_per_s_cap)

    # --- the engine thread -------------------------------------------------------------------

    def run(self) -> None:
        self._build(self.config)
        try:
            while not self._stopping.is_set():
                self._take_commands(self._wait_time())
                if not self._stopping.is_set() and self._step_due():
                    self._step()
        finally:
            self._close_log("finished")

    def _wait_time(self) -> float | None:
        """How long to block for a command: forever when idle, until the next step when rate-capped."""
        if not self._has_work():
            return None
        return max(0.0, self._next_step_at - time.monotonic())

    def _has_work(self) -> bool:
        if self.engine is None:
            return False
        if self._pending_steps:
            return True
        if self._paused:
            return False
        return self._abort_unreported or bool(self._scheduled) or self.engine.has_unfinished_requests()

    def _step_due(self) -> bool:
        return self._has_work() and time.monotonic() >= self._next_step_at

    def _take_commands(self, timeout: float | None) -> None:
        try:
            command = self._commands.get(timeout=timeout) if timeout != 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        self._apply(command)
        while True:
            try:
                self._apply(self._commands.get_nowait())
            except queue.Empty:
                return

    def _apply(self, command: _Add | _Command) -> None:
        if isinstance(command, _Add):
            self._add(command)
            return
        name, value = command.name, command.value
        if name == "stop":
            self._stopping.set()
        elif name == "abort" and self.engine is not None:
            self._scheduled = [entry for entry in self._scheduled if entry[2].request_id != value]
            heapq.heapify(self._scheduled)
            # The engine reports an abort with its next step: make sure one runs, even with nothing
            # else left to do (a paused engine reports it when the user steps or resumes).
            self._abort_unreported |= self.engine.abort_request(value)
        elif name in ("pause", "resume"):
            self._set_paused(name == "pause")
        elif name == "step":
            self._pending_steps += 1
            self._set_paused(True)
        elif name == "rate":
            self._steps_per_s_cap = value
            self._next_step_at = 0.0
            self._post_state()
        elif name == "preset":
            self._launch_preset(*value)
        elif name == "rebuild":
            self._build(value)

    def _set_paused(self, paused: bool) -> None:
        if paused != self._paused:
            self._paused = paused
            self._post_state()

    def _post_state(self) -> None:
        self.target.post_message(RunStateChanged(self.state))

    def _add(self, request: _Add) -> None:
        if self.engine is None:
            self.target.post_message(RequestRejected(request.request_id, "the engine is not running"))
            return
        try:
            self.engine.add_request(request.prompt, request.params, request_id=request.request_id)
        except (RequestError, ValueError, TypeError) as exc:
            self.target.post_message(RequestRejected(request.request_id, str(exc)))
            return
        self._unlogged[request.request_id] = (request.prompt_text, request.params.n)

    def _launch_preset(self, key: str, count: int) -> None:
        if self.engine is None:
            return
        try:
            planned = presets.build(key, count, presets.PresetContext.from_engine(self.engine, self.info))
        except ValueError as exc:
            self.target.post_message(EngineFailed(f"preset {key}: {exc}"))
            return
        for item in planned:
            number = next(self._ids)
            request = _Add(f"{key}-{number}", item.prompt, item.params, _prompt_text(item.prompt))
            if item.delay_steps:
                heapq.heappush(self._scheduled, (self._steps_done + item.delay_steps, number, request))
            else:
                self._add(request)

    def _add_scheduled(self) -> None:
        while self._scheduled and self._scheduled[0][0] <= self._steps_done:
            self._add(heapq.heappop(self._scheduled)[2])

    def _step(self) -> None:
        self._add_scheduled()
        self._pending_steps = max(0, self._pending_steps - 1)
        self._abort_unreported = False
        if self._steps_per_s_cap:
            self._next_step_at = time.monotonic() + 1.0 / self._steps_per_s_cap
        try:
            result = self.engine.step()
        except Exception as exc:  # the UI must survive any engine bug: show it, pause, wait for the user
            self._paused = True
            self._pending_steps = 0
            self.target.post_message(EngineFailed(f"engine step failed: {type(exc).__name__}: {exc}"))
            self._post_state()
            return
        self._steps_done += 1
        self._log(result)
        while not self._in_flight.acquire(timeout=0.1):
            if self._stopping.is_set():
                return
        self.target.post_message(EngineStepped(result))

    # --- building and logging ---------------------------------------------------------------

    def _build(self, config: EngineConfig) -> None:
        self.target.post_message(EngineStarting(config))
        try:
            engine = self._engine_factory(config, self.engine)
            info = engine_info(engine)
        except Exception as exc:  # a bad model path or an impossible pool must not kill the app
            self.target.post_message(EngineFailed(f"could not start the engine: {exc}"))
            return
        self._close_log("finished")
        self.engine, self.info, self.config = engine, info, config
        self._scheduled.clear()
        self._unlogged.clear()
        self._steps_done = 0
        self._logger = self._log_factory(config, info) if self._log_factory else None
        warning = getattr(self._logger, "warning", None)
        self.target.post_message(EngineReady(info, getattr(engine, "banner", ""), warning))
        self._post_state()

    def _log(self, result: StepResult) -> None:
        if self._logger is None:
            return
        if self._unlogged:
            # A request is logged once its prompt length is known: from its first output or snapshot row.
            sizes = {out.request_id: len(out.prompt_token_ids) for out in result.outputs}
            sizes.update((view.request_id, view.num_prompt_tokens) for view in result.snapshot.requests)
            for request_id in [rid for rid in self._unlogged if rid in sizes]:
                text, n = self._unlogged.pop(request_id)
                self._logger.request_added(request_id, text, sizes[request_id], n)
        self._logger.step(result)

    def _close_log(self, status: str) -> None:
        if self._logger is not None:
            self._logger.close(status)
            self._logger = None
