"""The engine thread: owns the LLMEngine, takes commands from a queue, posts one message per step.

Everything the UI asks for (add, abort, pause, single step, rate cap, preset,
rebuild) is a command (app/worker_commands.py) put on a queue and applied
between steps, so the engine is only ever touched by this thread. Results go
back with ``post_message``, which never waits for the UI; a semaphore bounds
how far the engine may run ahead of a UI that has stopped draining messages.
The run log is not the worker's business: ``log_factory`` attaches a logger to
each engine it builds as an engine observer, as every other caller does.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
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
from kvscope.app.worker_commands import (
    AbortRequest,
    AddRequest,
    LaunchPreset,
    Rebuild,
    SetPaused,
    SetRateCap,
    StepOnce,
    Stop,
    WorkerCommand,
)
from kvscope.engine.config import EngineConfig, RequestError, SamplingParams

MAX_STEPS_AHEAD_OF_UI = 256


def build_engine(config: EngineConfig, previous=None):
    """A new LLMEngine; reuses the previous engine's weights when only the cache settings changed."""
    from kvscope.engine import LLMEngine

    model = getattr(getattr(previous, "runner", None), "model", None)
    if model is not None and previous.config.model == config.model and previous.config.dtype == config.dtype:
        return LLMEngine(config, model=model, tokenizer=previous.tokenizer)
    return LLMEngine(config)


def engine_info(engine) -> EngineInfo:
    """Header facts, from the runner's RunnerInfo."""
    info = engine.info
    return EngineInfo(model_name=info.model_name, device=info.device, dtype=info.dtype,
                      block_size=info.block_size, num_blocks=info.num_device_blocks,
                      num_host_blocks=info.num_host_blocks, max_model_len=info.max_model_len,
                      kv_cache_bytes=info.kv_cache_bytes, config=engine.config)


class EngineWorker:
    """``run`` is the thread body (the app starts it as a thread worker); every other method is for the UI.

    ``log_factory(engine)`` is called for each engine built and returns its run logger (which it has
    attached as an engine observer, as ``runlog.record_run`` does) or None; the worker closes it when
    the engine is replaced or the thread ends.
    """

    def __init__(self, target, config: EngineConfig, *, engine_factory: Callable = build_engine,
                 log_factory: Callable[[Any], Any] | None = None,
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
        self._scheduled: list[tuple[int, int, AddRequest]] = []  # (engine step to add at, order, request)
        self._ids = itertools.count()
        self._steps_done = 0
        self._stopping = threading.Event()

    # --- the UI's side: every call only queues a command --------------------------------

    def send(self, command: WorkerCommand) -> None:
        """Queue a command for the engine thread. TypeError for anything that is not one."""
        if not isinstance(command, WorkerCommand):
            raise TypeError(f"not an engine worker command: {command!r} (see app/worker_commands.py)")
        if isinstance(command, Stop):
            self._stopping.set()    # a step in progress stops waiting for the UI at once
        self._commands.put(command)

    def submit(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        self.send(AddRequest(request_id, prompt, params))

    def abort(self, request_id: str) -> None:
        self.send(AbortRequest(request_id))

    def pause(self) -> None:
        self.send(SetPaused(True))

    def resume(self) -> None:
        self.send(SetPaused(False))

    def step_once(self) -> None:
        """Pause (if running) and advance exactly one step."""
        self.send(StepOnce())

    def set_rate_cap(self, steps_per_s: float | None) -> None:
        self.send(SetRateCap(steps_per_s))

    def launch_preset(self, key: str, count: int) -> None:
        self.send(LaunchPreset(key, count))

    def rebuild(self, config: EngineConfig) -> None:
        self.send(Rebuild(config))

    def stop(self) -> None:
        self.send(Stop())

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
            self._close_log()

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

    def _apply(self, command: WorkerCommand) -> None:
        match command:
            case AddRequest():
                self._add(command)
            case AbortRequest(request_id):
                self._abort(request_id)
            case SetPaused(paused):
                self._set_paused(paused)
            case StepOnce():
                self._pending_steps += 1
                self._set_paused(True)
            case SetRateCap(steps_per_s):
                self._steps_per_s_cap = steps_per_s
                self._next_step_at = 0.0
                self._post_state()
            case LaunchPreset(key, count):
                self._launch_preset(key, count)
            case Rebuild(config):
                self._build(config)
            case Stop():
                self._stopping.set()
            case _:     # send() refuses these; reaching here means something bypassed it
                raise TypeError(f"not an engine worker command: {command!r}")

    def _set_paused(self, paused: bool) -> None:
        if paused != self._paused:
            self._paused = paused
            self._post_state()

    def _post_state(self) -> None:
        self.target.post_message(RunStateChanged(self.state))

    def _add(self, request: AddRequest) -> None:
        if self.engine is None:
            self.target.post_message(RequestRejected(request.request_id, "the engine is not running"))
            return
        try:
            self.engine.add_request(request.prompt, request.params, request_id=request.request_id)
        except (RequestError, ValueError, TypeError) as exc:
            self.target.post_message(RequestRejected(request.request_id, str(exc)))

    def _abort(self, request_id: str) -> None:
        if self.engine is None:
            return
        self._scheduled = [entry for entry in self._scheduled if entry[2].request_id != request_id]
        heapq.heapify(self._scheduled)
        # The engine reports an abort with its next step: make sure one runs, even with nothing
        # else left to do (a paused engine reports it when the user steps or resumes).
        self._abort_unreported |= self.engine.abort_request(request_id)

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
            request = AddRequest(f"{key}-{number}", item.prompt, item.params)
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
        while not self._in_flight.acquire(timeout=0.1):
            if self._stopping.is_set():
                return
        self.target.post_message(EngineStepped(result))

    # --- building ----------------------------------------------------------------------------

    def _build(self, config: EngineConfig) -> None:
        self.target.post_message(EngineStarting(config))
        try:
            engine = self._engine_factory(config, self.engine)
            info = engine_info(engine)
        except Exception as exc:  # a bad model path or an impossible pool must not kill the app
            self.target.post_message(EngineFailed(f"could not start the engine: {exc}"))
            return
        self._close_log()
        self.engine, self.info, self.config = engine, info, config
        self._scheduled.clear()
        self._steps_done = 0
        self._logger = self._log_factory(engine) if self._log_factory else None
        warning = self._logger.warning if self._logger is not None else None
        self.target.post_message(EngineReady(info, engine.banner, warning))
        self._post_state()

    def _close_log(self) -> None:
        if self._logger is not None:
            self._logger.close("finished")
            self._logger = None
