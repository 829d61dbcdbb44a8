"""The engine thread: owns the LLMEngine, takes commands from a queue, hands its steps to the UI in batches.

Everything the UI asks for (add, abort, pause, single step, rate cap, preset,
rebuild) is a command (app/worker/commands.py) put on a queue and applied
between steps, so the engine is only ever touched by this thread. Results go
back with ``post_message``, which never waits for the UI; steps go in batches,
a few dozen posts a second however fast the engine steps, and never after a
message posted after them (app/worker/step_posting.py).
The run log is not the worker's business: ``log_factory`` attaches a logger to
each engine it builds as an engine observer, as every other caller does.

Nothing a command does may end the thread: a command that raises is refused
with a message and the thread goes on. Every request the engine accepted gets
exactly one final output, even when its engine goes away: a rebuild or quitting
aborts the requests in flight and hands on their final outputs, each saying why
in ``error`` (RequestOutput has no field of its own for an abort's reason).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvscope.app import messages
from kvscope.app.worker.commands import (
    AbortRequest,
    AddChatTurn,
    AddRequest,
    LaunchPlan,
    LaunchPreset,
    Rebuild,
    RunOnEngine,
    RunUntil,
    SetPaused,
    SetRateCap,
    SetRunLog,
    StepOnce,
    Stop,
    WorkerCommand,
)
from kvscope.app.worker.delayed import DelayedRequests
from kvscope.app.worker.factory import build_engine, engine_info
from kvscope.app.worker.requests import RequestCommands, describe_error
from kvscope.app.worker.step_posting import StepPosting
from kvscope.engine.config import EngineConfig

ENGINE_REBUILT = "the engine was restarted"
ENGINE_STOPPED = "kvscope quit while the request was in flight"


class EngineWorker(RequestCommands, StepPosting):
    """``run`` is the thread body (the app starts it as a thread worker); ``send`` and the methods
    that call it are for the UI. ``start``, ``run_once`` and ``shutdown`` are the thread body's
    parts, for a caller that drives the worker on its own thread (the tests).

    ``run_log`` says how each engine built is logged (app/runlog's RunLogSpec; SetRunLog changes it); or
    ``log_factory(engine)`` is called for each engine built and returns its run logger (which it has attached as
    an engine observer, as ``runlog.record_run`` does) or None. The worker closes it when the engine is replaced
    or the thread ends. ``on_engine_installed(engine)`` is told of each engine before it runs (kvscope --serve
    puts its server in front of it). ``clock`` times the rate cap.
    """

    def __init__(self, target, config: EngineConfig, *, engine_factory: Callable = build_engine,
                 log_factory: Callable[[Any], Any] | None = None, run_log=None,
                 on_engine_installed: Callable[[Any], None] | None = None,
                 paused: bool = False, steps_per_s_cap: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.config = config
        self.engine = None
        self.info: messages.EngineInfo | None = None
        self._engine_factory = engine_factory
        self._log_factory = log_factory if run_log is None else self._logging_as(run_log)
        self._on_engine_installed = on_engine_installed
        self._clock = clock
        self._logger = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        StepPosting.__init__(self)
        self._paused = paused
        self._steps_per_s_cap = steps_per_s_cap
        self._pending_steps = 0
        self._abort_unreported = False
        self._next_step_at = 0.0
        self._delayed = DelayedRequests()
        self._accepted: set[str] = set()     # added to the engine, final output not yet seen
        self._ids = itertools.count()
        self._steps_done = 0
        self._last_step = 0
        self._until: tuple[Callable, int] | None = None   # a RunUntil's condition and its last step
        self._queued = False    # requests added since the UI last saw the queues
        self._stopping = threading.Event()
        self._interrupted: str | None = None    # why the app stopped the thread, when it was cut short
        self._died: BaseException | None = None

    # --- the UI's side: every call only queues a command --------------------------------

    def send(self, command: WorkerCommand) -> None:
        """Queue a command for the engine thread. TypeError for anything that is not one."""
        if not isinstance(command, WorkerCommand):
            raise TypeError(f"not an engine worker command: {command!r} (see app/worker/commands.py)")
        if isinstance(command, Stop):
            self._interrupted = self._interrupted or command.interrupted
            self._stopping.set()    # a step in progress stops waiting for the UI at once
        self._commands.put(command)

    @property
    def state(self) -> messages.RunState:
        return messages.RunState(self._paused, self._steps_per_s_cap)

    @property
    def stopping(self) -> bool:
        """Stop was sent: the thread ending now is expected."""
        return self._stopping.is_set()

    # --- the engine thread -------------------------------------------------------------------

    def run(self) -> None:
        try:
            self.start()
            while not self._stopping.is_set():
                self.run_once(self._wait_time(), batch_steps=True)
        except BaseException as exc:    # the window must say the engine is gone, not look idle
            self._died = exc
            self._post(messages.EngineDied(describe_error(exc)))
            raise
        finally:
            self.shutdown()

    def start(self) -> None:
        """Build the first engine."""
        built = self._build(self.config)
        if built is not None:
            self._install(*built)

    def run_once(self, timeout: float | None = 0.0, batch_steps: bool = False) -> None:
        """Apply the queued commands (waiting up to ``timeout`` for the first, None: for ever), then
        take one step if one is due. The step is posted before this returns, unless ``batch_steps`` (the
        thread's own loop) lets it wait to join the next ones (app/worker/step_posting.py)."""
        if self._until is not None and not self._has_work():
            self._end_until(met=False)
        self._tell_steps(now=timeout != 0)     # before waiting, the UI hears of every step taken
        self._take_commands(timeout)
        if not self._stopping.is_set() and self._step_due():
            self._step()
        if not batch_steps:
            self._tell_steps()

    def shutdown(self) -> None:
        """The thread is ending: end the requests in flight and close the run log."""
        self._retire(ENGINE_STOPPED)
        self._tell_steps()

    def _wait_time(self) -> float | None:
        """How long to block for a command: forever when idle, until the next step when rate-capped."""
        if not self._has_work():
            return None
        return max(0.0, self._next_step_at - self._clock())

    def _has_work(self) -> bool:
        if self.engine is None:
            return False
        if self._pending_steps:
            return True
        if self._paused:
            return False
        return self._abort_unreported or bool(self._delayed) or self.engine.has_unfinished_requests()

    def _step_due(self) -> bool:
        return self._has_work() and self._clock() >= self._next_step_at

    def _take_commands(self, timeout: float | None) -> None:
        if timeout == 0 and self._commands.empty():     # the busy engine's every step: no exception to catch
            return
        try:
            command = self._commands.get(timeout=timeout) if timeout != 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        self._apply(command)
        while True:
            try:
                self._apply(self._commands.get_nowait())
            except queue.Empty:
                break
        if self._queued and self.engine is not None and not self._step_due():
            # Requests were added and no step is about to show them (paused, or rate-capped): show them now.
            self._queued = False
            self._post(messages.QueueChanged(self.engine.snapshot()))

    def _apply(self, command: WorkerCommand) -> None:
        """Apply one command; one that raises is refused with a message and changes nothing else."""
        try:
            self._dispatch(command)
        except Exception as exc:
            if isinstance(command, AddRequest):
                self._reject(command.request_id, exc)
            else:
                self._post(messages.CommandRejected(type(command).__name__, describe_error(exc)))

    def _dispatch(self, command: WorkerCommand) -> None:
        match command:
            case AddRequest():
                self._add(command)
            case AddChatTurn(request_id, turns, params):
                self._add_chat_turn(request_id, turns, params)
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
            case LaunchPlan(plan):
                self._launch_plan(plan)
            case RunUntil(condition, max_steps):
                self._until = (condition, self._steps_done + max_steps)
                self._set_paused(False)
            case Rebuild(config):
                self._rebuild(config)
            case RunOnEngine(call):
                call()
            case SetRunLog(spec):
                self._log_factory = self._logging_as(spec)
            case Stop():
                self._stopping.set()
            case _:     # send() refuses these; reaching here means something bypassed it
                raise TypeError(f"not an engine worker command: {command!r}")

    def _logging_as(self, spec) -> Callable[[Any], Any]:
        return functools.partial(spec.open, on_failure=self._log_failed)

    def _log_failed(self, warning: str) -> None:
        # From the run log's writer thread: straight to the UI (posting is thread-safe), never through the batch.
        self.target.post_message(messages.RunLogFailed(warning))

    def _set_paused(self, paused: bool) -> None:
        if paused != self._paused:
            self._paused = paused
            self._post_state()

    def _post_state(self) -> None:
        self._post(messages.RunStateChanged(self.state))

    def _step(self) -> None:
        for request in self._delayed.pop_due(self._steps_done):
            self._add(request)
        self._queued = False
        self._pending_steps = max(0, self._pending_steps - 1)
        self._abort_unreported = False
        if self._steps_per_s_cap:
            self._next_step_at = self._clock() + 1.0 / self._steps_per_s_cap
        try:
            result = self.engine.step()
        except Exception as exc:  # the UI must survive any engine bug: show it, pause, wait for the user
            self._paused = True
            self._pending_steps = 0
            self._post(messages.EngineFailed(f"engine step failed: {describe_error(exc)}"))
            self._post_state()
            return
        self._steps_done += 1
        self._last_step = result.stats.step
        self._forget_finished(result.finished_outputs)
        self._post_step(result, self.engine)
        if self._until is not None:
            self._check_until(result)

    def _forget_finished(self, finished: list) -> None:
        for output in finished:
            self._accepted.discard(output.request_id)
        self._unwatch_finished(finished, self._steps_done)

    def _check_until(self, result) -> None:
        condition, last = self._until
        try:
            met = bool(condition(result))
        except Exception as exc:  # a bad condition ends the run where it is; the engine is fine
            self._post(messages.EngineFailed(f"run-until condition failed: {type(exc).__name__}: {exc}"))
            met = False
            last = self._steps_done
        if met or self._steps_done >= last:
            self._end_until(met)

    def _end_until(self, met: bool) -> None:
        """A RunUntil is over: pause where it stopped and say at which step."""
        self._until = None
        self._pending_steps = 0
        self._set_paused(True)
        self._post(messages.RunUntilDone(self._last_step, met))

    # --- building and retiring engines ---------------------------------------------------------

    def _rebuild(self, config: EngineConfig) -> None:
        """Build first: if that fails, the engine in use goes on as it was."""
        built = self._build(config)
        if built is not None:
            self._retire(ENGINE_REBUILT)
            self._install(*built)

    def _build(self, config: EngineConfig) -> tuple[Any, messages.EngineInfo, EngineConfig] | None:
        self._post(messages.EngineStarting(config))
        try:
            engine = self._engine_factory(config, self.engine)
            return engine, engine_info(engine), config
        except Exception as exc:  # a bad model path or an impossible pool must not kill the app
            self._post(messages.EngineBuildFailed(f"could not start the engine: {exc}", self.info))
            return None

    def _install(self, engine, info: messages.EngineInfo, config: EngineConfig) -> None:
        self.engine, self.info, self.config = engine, info, config
        self._steps_done = self._last_step = 0
        self._abort_unreported = False
        warning = None
        if self._on_engine_installed is not None:
            self._on_engine_installed(engine)
        try:
            self._logger = self._log_factory(engine) if self._log_factory else None
        except Exception as exc:    # the run log is never worth the engine
            self._logger, warning = None, f"run log off: {describe_error(exc)}"
        if self._logger is not None:
            warning = self._logger.warning
        self._post(messages.EngineReady(info, engine.banner, warning, getattr(self._logger, "run_id", None)))
        self._post_state()

    def _retire(self, reason: str) -> None:
        """The engine is being replaced or left: every request in flight gets its final output,
        saying ``reason``; the run log records them and is closed."""
        engine, logger = self.engine, self._logger
        self.engine, self._logger = None, None
        self._delayed.clear()     # never accepted by the engine: nothing to end
        if engine is None:
            return
        aborted: list[str] = []
        try:
            aborted = [rid for rid in sorted(self._accepted) if engine.abort_request(rid)]
            if aborted or self._abort_unreported:
                self._final_step(engine, logger, set(aborted), reason)
        except Exception as exc:    # a broken engine: say so for each request, close the log anyway
            for request_id in sorted(self._accepted):
                self._post(messages.RequestRejected(
                    request_id, f"{reason}; its final output was lost ({describe_error(exc)})"))
        finally:
            self._accepted.clear()
            self._watched.clear()
            self._abort_unreported = False
            if logger is not None:
                logger.close(*self._closing_status(len(aborted), reason))

    def _final_step(self, engine, logger, aborted: set[str], reason: str) -> None:
        """One last step hands out the aborted requests' final outputs, with the reason added."""
        if logger is not None:
            logger.detach()     # it hears this step below, with the reasons
        result = engine.step()
        outputs = [output._replace(error=reason) if output.request_id in aborted and output.finished
                   else output for output in result.outputs]
        result = dataclasses.replace(result, outputs=outputs)
        if logger is not None:
            logger.step(result)
        self._post_step(result, engine)

    def _closing_status(self, num_aborted: int, reason: str) -> tuple[str, str | None]:
        if self._died is not None:
            return "crashed", f"the engine thread died: {describe_error(self._died)}"
        if self._interrupted is not None:
            return "interrupted", self._interrupted
        if num_aborted:
            return "interrupted", f"{num_aborted} request(s) in flight aborted: {reason}"
        return "finished", None
