"""The kvscope Textual app: starts the engine thread, routes its messages, holds the teaching controls."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from textual.app import SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.worker import Worker, WorkerState

from kvscope.app.actions import ACTIONS, REPLACED_SYSTEM_COMMANDS, bindings
from kvscope.app.attach.window.replay_view import replay_screen_for
from kvscope.app.engine_controls import EngineControls
from kvscope.app.lessons import LESSONS
from kvscope.app.load import presets
from kvscope.app.load.presets import PRESETS
from kvscope.app.messages import (
    ChatSubmitted,
    CommandRejected,
    EngineBuildFailed,
    EngineDied,
    EngineFailed,
    EngineInfo,
    EngineReady,
    EngineStarting,
    PresetLaunched,
    QueueChanged,
    RequestRejected,
    RunLogFailed,
    RunState,
    RunStateChanged,
    RunUntilDone,
    StepsReady,
)
from kvscope.app.runlog import RunLogSpec
from kvscope.app.screens.explain import ExplainScreen
from kvscope.app.screens.history import HistoryScreen
from kvscope.app.screens.lesson import LessonScreen
from kvscope.app.screens.main import MainScreen
from kvscope.app.screens.quit import ConfirmAbort, ConfirmQuit, ShuttingDown
from kvscope.app.teaching import LessonControls
from kvscope.app.themed_app import APP_CSS, ThemedApp
from kvscope.app.widgets.chat import DEFAULT_MAX_TOKENS
from kvscope.app.widgets.key_bar import key_label
from kvscope.app.widgets.system import SystemSampler
from kvscope.app.worker.commands import AddChatTurn, LaunchPreset, RunOnEngine, SetPaused, Stop
from kvscope.app.worker.factory import build_engine, first_engine_then_build
from kvscope.app.worker.process import EngineProcess
from kvscope.app.worker.thread import EngineWorker
from kvscope.engine.config import EngineConfig, model_sampling
from kvscope.engine.model.packaged import fetch_hint
from kvscope.settings import settings
from kvscope.themes import THEME_CSS_PATHS

SHUTDOWN_POLL_S = 0.02
TERMINAL_CLOSED = "terminal closed"
TERMINATED = "terminated (SIGTERM)"
# The signals that end the app as a quit does, each with the reason its run is logged interrupted for.
ENDING_SIGNALS = {"SIGHUP": TERMINAL_CLOSED, "SIGTERM": TERMINATED}
REFUSALS_GATHER_S = 0.25


def runnable_warning(info: EngineInfo) -> str | None:
    """Why an engine can run no request at all (contiguous rows larger than the pool), with the fix."""
    try:
        runner = info.runner
        presets.PresetContext(runner.block_size, runner.num_device_blocks, runner.max_model_len,
                              info.config.max_num_batched_tokens, len, allocator=info.config.allocator
                              ).check_runnable()
    except ValueError as exc:
        return str(exc)[0].upper() + str(exc)[1:] + "."
    return None


class KVScopeApp(LessonControls, EngineControls, ThemedApp):
    TITLE = "kvscope"
    CSS_PATH = [APP_CSS, *THEME_CSS_PATHS]
    BINDINGS = bindings()

    def __init__(self, config: EngineConfig, *, db_path: str | Path | None = None, log_enabled: bool = True,
                 engine_factory: Callable = build_engine, system_sampler: SystemSampler | None = None,
                 paused: bool = False, steps_per_s_cap: float | None = None,
                 screenshot_dir: str | Path | None = None, chat_max_tokens: int = DEFAULT_MAX_TOKENS,
                 first_lesson: str | None = None, serve=None,
                 chat_sampling: tuple[tuple[str, float | int], ...] = (),
                 fetch_hint: Callable[[str], str | None] = fetch_hint, engine_process: bool = False) -> None:
        super().__init__()
        self.config = config
        # How to fetch a model offered by name that a lesson runs on, when it is not in the cache yet: the
        # window never fetches one itself. Given with engine_factory by whatever stands in for model loading.
        self.fetch_hint = fetch_hint
        self.log_enabled = log_enabled
        self.db_path = (Path(db_path) if db_path else settings().db_path) if log_enabled else None
        self.screenshot_dir = Path(screenshot_dir or os.getcwd())
        # The sampling knobs typed on the command line, over the model's own defaults for every chat turn.
        self.chat_sampling = chat_sampling
        self.main = MainScreen(system_sampler=system_sampler, chat_max_tokens=chat_max_tokens,
                               chat_sampling=chat_sampling)
        self.lesson_screen: LessonScreen | None = None
        # The engine's worker: in a process of its own (``engine_process``: run_app waits there for the first
        # engine before the window opens), else on a thread of this one (a server in front of it, the tests).
        if engine_process:
            self.worker = EngineProcess(self, config, engine_factory=engine_factory, run_log=self.run_log_spec(),
                                        paused=paused, steps_per_s_cap=steps_per_s_cap)
        else:
            self.worker = EngineWorker(self, config, engine_factory=engine_factory, run_log=self.run_log_spec(),
                                       on_engine_installed=serve.engine_installed if serve is not None else None,
                                       paused=paused, steps_per_s_cap=steps_per_s_cap)
        self.engine_died: str | None = None     # why the engine thread ended, once it has
        # The cap the user asked for, kept here: presses that arrive before the engine thread applied
        # the previous one must each move it a notch.
        self.rate_cap = steps_per_s_cap
        self.engine_thread = None   # Textual's Worker running the engine thread
        self.run_id: int | None = None          # the run log's run of the engine now running
        self.run_log_warning: str | None = None   # why that engine is not logged, when it is not
        self._lesson_log_dir: tempfile.TemporaryDirectory | None = None
        self._state_before_lesson: RunState | None = None   # paused or not, and the step cap, to come back to
        self._first_lesson = first_lesson
        self._refused: list[tuple[str, str]] = []
        # kvscope --serve: the API in front of this window's engine (app/serve/hosted.py's HostedServe, made by
        # the command line). Its requests are engine requests like chat turns ("http-N" in the queues); their
        # adds and aborts run on the engine thread between steps.
        self.serve = serve
        if serve is not None:
            serve.wake = lambda: self.worker.send(RunOnEngine(serve.run_pending))

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Stopping a reply is offered (footer, keys panel) only while one streams."""
        if action == "abort_reply":
            return self.main.reply_streaming
        return True

    def get_default_screen(self) -> Screen:
        return self.main

    def on_ready(self) -> None:
        self._catch_terminal_closing()
        # Started once the live view is composed, so the first messages find their panels.
        self.engine_thread = self.run_worker(self.worker.run, thread=True, name="engine", group="engine",
                                             exit_on_error=False)
        if self._first_lesson == "":
            self.action_lessons()
        elif self._first_lesson:
            self.start_lesson(self._first_lesson)

    def _catch_terminal_closing(self) -> None:
        """Closing the terminal sends SIGHUP, and `kill` or a process manager SIGTERM, whose defaults end the
        process where it stands: the run was then found "running" with its process gone and called crashed, as
        an exception would be. Each is a quit instead, the run logged interrupted with the reason."""
        for name, reason in self._ending_signals().items():
            asyncio.get_running_loop().add_signal_handler(getattr(signal, name), self.shut_down, reason)

    @staticmethod
    def _ending_signals() -> dict[str, str]:
        """ENDING_SIGNALS this platform has; none off the main thread, where no handler can be set."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {name: reason for name, reason in ENDING_SIGNALS.items() if hasattr(signal, name)}

    def on_unmount(self) -> None:
        for name in self._ending_signals():
            asyncio.get_running_loop().remove_signal_handler(getattr(signal, name))
        if self.serve is not None:
            self.serve.close()      # its requests end with "abort", stepped by the engine thread still running
        self.worker.send(Stop())
        if self._lesson_log_dir is not None:
            self._lesson_log_dir.cleanup()

    def run_log_spec(self) -> RunLogSpec:
        """How the engines built now are logged: a lesson's as the lesson's, named for it."""
        lesson = self.lesson_screen.lesson.name if self.lesson_screen is not None else None
        return RunLogSpec("lesson" if lesson else "app", lesson, str(self.db_path) if self.db_path else None,
                          self.log_enabled)

    # --- from the engine thread -------------------------------------------------------------------

    def on_engine_starting(self, message: EngineStarting) -> None:
        self.main.show_starting(message.config.model)

    def on_engine_ready(self, message: EngineReady) -> None:
        self.run_id, self.run_log_warning = message.run_id, message.log_warning
        self.main.engine_ready(message.info)
        if self.lesson_screen is not None:
            self.lesson_screen.engine_ready(message.info)
        if message.log_warning:
            self.notify(message.log_warning, title="Run log", severity="warning", timeout=12)
        warning = runnable_warning(message.info)
        if warning:
            self.notify(warning, title="No request can run", severity="warning", timeout=15)
        if self.serve is not None and self.serve.url:
            self.main.show_serving(self.serve.url)
            network = self.serve.network_warning()
            self.notify(f"OpenAI API on {self.serve.url}/v1; watch it with kvscope attach {self.serve.url}"
                        + (f". {network}" if network else ""), title="Serving",
                        severity="warning" if network else "information", timeout=12)

    def on_steps_ready(self, message: StepsReady) -> None:
        main = self.main
        attached = main.is_attached    # steps still arrive while the app shuts down
        steps = message.batch.take()
        self.worker.ack(len(steps))
        for stepped in steps:
            if attached:
                main.ingest(stepped.result)
            if self.lesson_screen is not None:
                self.lesson_screen.ingest(stepped.result)
        if attached:
            main.paint()    # on the wake that brought the steps, not on a timer's wake of its own

    def on_queue_changed(self, message: QueueChanged) -> None:
        self.main.show_queue(message.snapshot)

    def on_run_until_done(self, message: RunUntilDone) -> None:
        if self.lesson_screen is not None:
            self.lesson_screen.until_done(message.step, message.met)

    def on_engine_failed(self, message: EngineFailed) -> None:
        # The engine thread has paused; requests in flight (the chat reply too) go on after a resume.
        self.notify(message.error, title="Engine", severity="error", timeout=15)

    def on_engine_build_failed(self, message: EngineBuildFailed) -> None:
        self.main.engine_not_ready(message.still_running, message.error)
        kept = " The engine before it goes on." if message.still_running else ""
        self.notify(message.error + kept, title="Engine", severity="error", timeout=15)

    def on_engine_died(self, message: EngineDied) -> None:
        self._say_engine_died(message.error)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        # The engine thread ended without being told to (it posts EngineDied first when it can).
        worker = event.worker
        if worker.name == "engine" and event.state in (WorkerState.ERROR, WorkerState.SUCCESS) \
                and not self.worker.stopping:
            self._say_engine_died(f"{type(worker.error).__name__}: {worker.error}" if worker.error
                                  else "the engine thread ended")

    def _say_engine_died(self, error: str) -> None:
        if self.engine_died is not None:
            return
        self.engine_died = error
        self.main.engine_died(error)
        self.notify(f"The engine thread stopped: {error}. Requests no longer run; restart kvscope.",
                    title="Engine", severity="error", timeout=60)

    def on_request_rejected(self, message: RequestRejected) -> None:
        self.main.chat_refused(message.request_id, message.error)
        # Refusals come in bursts (a preset's requests, one after the other): gathered for a moment and
        # told in one toast, never one toast each.
        if not self._refused:
            self.set_timer(REFUSALS_GATHER_S, self._tell_refusals)
        self._refused.append((message.request_id, message.error))

    def _tell_refusals(self) -> None:
        refused, self._refused = self._refused, []
        if len(refused) == 1:
            request_id, error = refused[0]
            self.notify(error, title=f"Request {request_id} refused", severity="error", timeout=10)
        elif refused:
            self.notify(f"first: {refused[0][1]}", title=f"{len(refused)} requests refused", severity="error",
                        timeout=10)

    def on_command_rejected(self, message: CommandRejected) -> None:
        self.notify(message.error, title=f"{message.command} refused", severity="error", timeout=10)

    def on_run_log_failed(self, message: RunLogFailed) -> None:
        self.notify(message.warning, title="Run log", severity="warning", timeout=30)

    def on_run_state_changed(self, message: RunStateChanged) -> None:
        self.main.show_state(message.state)

    # --- from the panels ----------------------------------------------------------------------------

    def on_chat_submitted(self, message: ChatSubmitted) -> None:
        # The model's own sampling defaults, as `kvscope chat` and vLLM use them (greedy for SmolLM2), under the
        # knobs typed on the command line.
        info = self.main.engine_info
        params = model_sampling(info.runner.sampling_defaults if info else (), max_tokens=message.max_tokens,
                                **dict(self.chat_sampling))
        self.worker.send(AddChatTurn(message.request_id, message.messages, params))
        self.main.chat_sent(message.request_id)

    def on_preset_launched(self, message: PresetLaunched) -> None:
        self.worker.send(LaunchPreset(message.preset_key, message.count))
        self.notify(f"{PRESETS[message.preset_key].title}: {message.count} sent", timeout=3)

    # --- actions -----------------------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for command in super().get_system_commands(screen):
            if command.title not in REPLACED_SYSTEM_COMMANDS:
                yield command
        for action in ACTIONS:
            key = f" ({key_label(self, Binding(action.keys.split(',')[0], action.action))})" if action.keys else ""
            yield SystemCommand(action.title + key, action.help, partial(self.run_action, action.action))
        for lesson in LESSONS.values():
            yield SystemCommand(f"Lesson: {lesson.name}", lesson.summary, partial(self.start_lesson, lesson.name))
        # Each load preset straight from the palette: the picker in the load generator is many keys away.
        for preset in PRESETS.values():
            yield SystemCommand(f"Load: {preset.title}", f"Send {preset.default_count}: {preset.description}",
                                partial(self.send_preset, preset.key))

    # --- aborting what is in flight: quitting, restarting ---------------------------------------------

    def _in_flight(self) -> str | None:
        """What a restart or quitting would abort, in words ("24 requests"); None when nothing is in flight."""
        count = len(self.main.requests_in_flight())
        return f"{count} request{'s' if count != 1 else ''}" if count else None

    def confirm_abort(self, question: str, doing: str, go: Callable[[str | None], None], yes: str) -> None:
        """``go(aborted)`` at once when nothing is in flight; else after the user says yes to ``question``
        (``doing`` aborts them), with ``aborted`` saying how many ("24 requests") for the toast that follows."""
        in_flight = self._in_flight()
        if in_flight is None:
            go(None)
            return
        if isinstance(self.screen, ConfirmAbort):
            return

        def answered(yes: bool | None) -> None:
            if yes:
                go(in_flight)

        self.push_screen(ConfirmAbort(question, in_flight, doing, yes=yes), answered)

    async def action_quit(self) -> None:
        if isinstance(self.screen, (ConfirmQuit, ShuttingDown)):
            return
        in_flight = self._in_flight()
        if in_flight is None:
            self.shut_down()
            return

        def answered(quit_now: bool | None) -> None:
            if quit_now:
                self.shut_down()

        self.push_screen(ConfirmQuit(in_flight), answered)

    def shut_down(self, interrupted: str | None = None) -> None:
        """Say so, stop the engine thread, and exit once it has ended (its step done, its run log closed). A
        hosted server closes first, off the UI thread: its aborts run on the engine thread, still stepping, so
        every stream it serves ends with finish_reason "abort" and [DONE] (a paused engine resumes to report them)."""
        self.push_screen(ShuttingDown())
        if self.serve is not None:
            serve = self.serve
            self.worker.send(SetPaused(False))
            self.run_worker(lambda: (serve.close(), self.worker.send(Stop(interrupted))), thread=True,
                            name="serve-close")
        else:
            self.worker.send(Stop(interrupted))

        def exit_when_stopped() -> None:
            if self.engine_thread is None or self.engine_thread.is_finished:
                self.exit()

        self.set_interval(SHUTDOWN_POLL_S, exit_when_stopped)

    def action_focus_panel(self, widget_id: str) -> None:
        found = self.screen.query(f"#{widget_id}")
        if found:
            found.first().focus()

    def action_explain(self) -> None:
        if not isinstance(self.screen, ExplainScreen):
            self.push_screen(ExplainScreen())

    def action_history(self) -> None:
        if not isinstance(self.screen, HistoryScreen):
            self.push_screen(HistoryScreen(self.db_path, replay_for=replay_screen_for))




def run_app(config: EngineConfig, *, db_path: str | None, log_enabled: bool, engine=None,
            lesson: str | None = None, serve=None, chat_sampling: tuple = (), engine_process: bool = False) -> int:
    """Open the window; ``engine``, when given, is the first engine (built, and so checked, before);
    ``lesson`` opens a lesson at once ("" opens the list of lessons); ``serve`` serves the engine over HTTP;
    ``engine_process`` runs the engine in a process of its own, whose first engine is built (and so checked)
    before the window opens."""
    factory = build_engine if engine is None else first_engine_then_build(engine)
    app = KVScopeApp(config, db_path=db_path, log_enabled=log_enabled, engine_factory=factory, first_lesson=lesson,
                     serve=serve, chat_sampling=chat_sampling, engine_process=engine_process)
    if engine_process:
        print(f"kvscope: loading {config.model} in the engine process …", file=sys.stderr, flush=True)
        built = app.worker.wait_until_built()
        if not isinstance(built, EngineReady):
            error = " ".join(getattr(built, "error", "the engine process did not start").split())   # one line
            print(f"kvscope: error: {error}", file=sys.stderr)
            app.worker.close()
            return 2
    app.run()
    return app.return_code or 0
