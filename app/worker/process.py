"""The engine in a process of its own: the window's EngineWorker, run in a child process behind a pipe.

The window and the engine share no interpreter lock this way. In one process, the window's drawing and even its
idle event loop took the engine thread's turns: with the window open, the engine ran 12-18% slower on a 2-core
machine (docs/performance.md), as vLLM's engine core would if its API server shared its process.

The child runs the same EngineWorker the in-process mode runs, on its main thread; a second thread there takes
what the window sends: commands (pickled, so they must be plain values or module-level functions: a closure is
refused at ``send``), step acknowledgements (in bulk), and whether the window takes steps whole. Everything the
worker posts comes back over the pipe (encoded by app/worker/wire.py, framed by app/worker/outbox.py, sent by
whichever thread posts it) and is posted to the window as the same message. ``EngineProcess``
is the window's side, with the worker's interface (``send``, ``ack``, ``whole_steps``, ``state``, ``stopping``,
``run`` as the body of a thread that reads the pipe).

The child ignores Ctrl-C and the terminal closing (the window handles both and stops it with Stop), writes its
stderr to a file whose last lines the window shows if it dies, and stops on its own, closing its run log as
interrupted, if the window's process goes (its end of the pipe closes, or it exits and sends SIGTERM).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvscope.app import messages
from kvscope.app.collector import tune_for_engine_loop
from kvscope.app.worker.commands import Stop, WorkerCommand
from kvscope.app.worker.factory import build_engine
from kvscope.app.worker.outbox import FrameReader, FrameWriter
from kvscope.app.worker.step_posting import MAX_STEPS_AHEAD_OF_UI
from kvscope.app.worker.wire import MessageDecoder, MessageEncoder
from kvscope.engine.config import EngineConfig

_COMMAND, _ACK, _WHOLE_STEPS = "command", "ack", "whole_steps"
STDERR_TAIL_LINES = 5
WINDOW_GONE = "the window closed"
JOIN_S = 10.0
ACK_EVERY_STEPS = MAX_STEPS_AHEAD_OF_UI // 2
ACK_INTERVAL_S = 0.25


class _PipeTarget:
    """What the worker in the child posts to: each message encoded where it is posted, in order (the run log's
    writer thread posts its failure from its own thread), and sent to the window without waiting for it
    (app/worker/outbox.py). A batch of steps is encoded when it is posted, so the worker decides its posts as
    steps join (app/worker/step_posting.py), and the steps it thins are encoded as they join."""

    ENCODES_WHEN_POSTED = True

    def __init__(self, conn) -> None:
        self._encoder = MessageEncoder()
        self._lock = threading.Lock()
        self._frames = FrameWriter(conn.fileno())
        # The last batch of steps carried the pool's arrays whole: what it cost says nothing of the next
        # (app/worker/step_posting.py).
        self.steps_sent_whole = False

    @property
    def on_lost(self) -> Callable[[], None]:
        return self._frames.on_lost

    @on_lost.setter
    def on_lost(self, call: Callable[[], None]) -> None:
        self._frames.on_lost = call

    def post_message(self, message) -> bool:
        with self._lock:    # encoded and sent in one order
            data = self._encoder.encode(message)
            if isinstance(message, messages.StepsReady):
                self.steps_sent_whole = self._encoder.sent_whole
            return self._frames.send(data)

    def thin_step(self, result):
        """A step no post will draw, encoded as it joins its batch (app/worker/wire.py)."""
        with self._lock:
            return self._encoder.thin_step(result)

    def restore_views(self, step, snapshot):
        with self._lock:
            return self._encoder.restore_views(step, snapshot)

    def close(self) -> None:
        """Send what was posted (the run's last messages), then stop sending."""
        self._frames.close()


def _child_main(conn, config: EngineConfig, engine_factory: Callable, run_log, paused: bool,
                steps_per_s_cap: float | None, stderr_path: str) -> None:
    from kvscope.app.worker.thread import EngineWorker

    tune_for_engine_loop()      # a new interpreter: the command line's setting stayed in the window's process
    for name in ("SIGINT", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    _redirect_output(stderr_path)
    target = _PipeTarget(conn)
    worker = EngineWorker(target, config, engine_factory=engine_factory, run_log=run_log, paused=paused,
                          steps_per_s_cap=steps_per_s_cap, on_engine_installed=_freeze_heap)
    target.on_lost = lambda: worker.send(Stop(WINDOW_GONE))
    # The window's process exiting ends its daemon children with SIGTERM (multiprocessing does, at exit): the run
    # log is closed as for any other way the window goes.
    signal.signal(signal.SIGTERM, lambda _signal, _frame: worker.send(Stop(WINDOW_GONE)))
    threading.Thread(target=_take_from_window, args=(conn, worker), name="engine-inbox", daemon=True).start()
    try:
        worker.run()
    finally:
        target.close()
        conn.close()


def _freeze_heap(engine) -> None:
    """The new engine's objects live as long as it runs: out of the collector's reach, a full collection (which
    the steps' garbage sets off every few seconds) walks only what came since. In the window's process the window
    does this for both (MainScreen.engine_ready); here nobody else would. The engine replaced is collected first."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _redirect_output(stderr_path: str) -> None:
    """The window owns the terminal: the child's prints would draw over it."""
    with open(os.devnull, "wb") as null, open(stderr_path, "ab") as err:
        os.dup2(null.fileno(), 1)
        os.dup2(err.fileno(), 2)
    sys.stdout = open(1, "w", closefd=False)    # noqa: SIM115 - the process's own streams, kept for its lifetime
    sys.stderr = open(2, "w", closefd=False)    # noqa: SIM115


def _take_from_window(conn, worker) -> None:
    while True:
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):     # the window went away without a Stop
            worker.send(Stop(WINDOW_GONE))
            return
        if kind == _COMMAND:
            worker.send(value)
        elif kind == _ACK:
            worker.ack(value)
        elif kind == _WHOLE_STEPS:
            worker.whole_steps = value


class EngineProcess:
    """The window's side of an engine process. ``wait_until_built`` starts it and waits for the first engine (the
    command line checks it before the window opens); ``run``, on a thread, starts it if need be and posts to
    ``target`` every message the engine's worker posts, and EngineDied if the process ends without being told
    to. ``run_log`` is the first engines' RunLogSpec (app/runlog)."""

    def __init__(self, target, config: EngineConfig, *, engine_factory: Callable = build_engine,
                 run_log=None, paused: bool = False, steps_per_s_cap: float | None = None) -> None:
        self.target = target
        self.config = config
        self._state = messages.RunState(paused, steps_per_s_cap)
        self._whole_steps = False
        self._stopping = threading.Event()
        self._decoder = MessageDecoder()
        self._early: list = []      # read by wait_until_built, handed on by run
        self._unacked, self._acked_at = 0, 0.0      # steps handled and not yet acknowledged (``ack``)
        self._send_lock = threading.Lock()
        self._stderr = Path(tempfile.mkstemp(prefix="kvscope-engine-", suffix=".log")[1])
        context = multiprocessing.get_context("spawn")    # never fork a process that runs threads
        self._conn, self._child_end = context.Pipe()
        self._frames = FrameReader(self._conn.fileno())     # what the engine sends (app/worker/outbox.py)
        self._process = context.Process(
            target=_child_main, name="kvscope-engine", daemon=True,
            args=(self._child_end, config, engine_factory, run_log, paused, steps_per_s_cap, str(self._stderr)))

    # --- the window's side: what EngineWorker offers -------------------------------------------------------

    def send(self, command: WorkerCommand) -> None:
        """Queue a command for the engine. TypeError for anything that is not one, or that cannot be pickled
        (a closure: the engine is in another process)."""
        if not isinstance(command, WorkerCommand):
            raise TypeError(f"not an engine worker command: {command!r} (see app/worker/commands.py)")
        if isinstance(command, Stop):
            self._stopping.set()
        self._to_child(_COMMAND, command)

    def ack(self, steps: int = 1) -> None:
        """Acknowledgements cross in bulk: each wakes a thread of the engine process, and a woken thread costs
        the engine (app/worker/outbox.py). Holding fewer than ACK_EVERY_STEPS never stalls it: it waits only with
        MAX_STEPS_AHEAD_OF_UI in flight, having posted them all, so the window then holds at least the rest."""
        if steps < 1:
            return
        self._unacked += steps
        clock = time.monotonic()
        if self._unacked >= ACK_EVERY_STEPS or clock - self._acked_at >= ACK_INTERVAL_S:
            self._to_child(_ACK, self._unacked)
            self._unacked, self._acked_at = 0, clock

    @property
    def whole_steps(self) -> bool:
        return self._whole_steps

    @whole_steps.setter
    def whole_steps(self, whole: bool) -> None:
        self._whole_steps = whole
        self._to_child(_WHOLE_STEPS, whole)

    @property
    def state(self) -> messages.RunState:
        """As the engine last said (RunStateChanged), which is what the in-process worker's state says too."""
        return self._state

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _to_child(self, kind: str, value) -> None:
        try:
            with self._send_lock:
                self._conn.send((kind, value))
        except (AttributeError, TypeError, ValueError, pickle.PicklingError) as exc:   # a closure, a lambda
            raise TypeError(f"cannot send {value!r} to the engine process: {exc}") from exc
        except OSError:     # the process is gone; run() says so
            pass

    # --- the process ---------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._process.pid is None:
            self._process.start()
            self._child_end.close()

    def wait_until_built(self, timeout: float | None = None):
        """Start the process and read its messages until the first engine is built or failed to: EngineReady,
        EngineBuildFailed or EngineDied (None if ``timeout`` passed). What was read is handed on by ``run``."""
        self.start()
        while self._frames.poll(timeout):
            message = self._receive()
            if message is None:
                return self._died_message()
            self._early.append(message)
            if isinstance(message, (messages.EngineReady, messages.EngineBuildFailed, messages.EngineDied)):
                return message
        return None

    def run(self) -> None:
        """The reading thread's body: until the process ends."""
        self.start()
        early, self._early = self._early, []
        for message in early:
            self._deliver(message)
        while (message := self._receive()) is not None:
            self._deliver(message)
        self._process.join(JOIN_S)
        if not self.stopping:
            self._deliver(self._died_message())
        self._stderr.unlink(missing_ok=True)

    def _receive(self):
        frame = self._frames.read()
        return None if frame is None else self._decoder.decode(frame)

    def _deliver(self, message) -> None:
        if isinstance(message, messages.RunStateChanged):
            self._state = message.state
        self.target.post_message(message)

    def _died_message(self) -> messages.EngineDied:
        self._process.join(JOIN_S)
        code = self._process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        tail = self._stderr.read_text(errors="replace").strip().splitlines()[-STDERR_TAIL_LINES:] \
            if self._stderr.exists() else []
        return messages.EngineDied(f"the engine process ended ({how})" + (f": {' / '.join(tail)}" if tail else ""))

    def close(self) -> None:
        """Stop the process (one that never ran for a window: its first engine failed) and wait for it to end."""
        self.send(Stop())
        if self._process.pid is not None:
            self._process.join(JOIN_S)
            if self._process.is_alive():
                self._process.kill()
        self._stderr.unlink(missing_ok=True)
