"""AttachApp: the kvscope window over a vLLM server. The data source thread feeds it frames.

It is the app's window with another data source, so the themes, the run log's
History (F9, where the session shows up as a "vllm" run while it is recorded),
screenshots (Ctrl+S), the keys (?) and quitting (q or F10) work as in the app.

The data source runs in a daemon thread of its own, not a Textual thread worker:
the worker pool is joined when the app's event loop closes, so a thread that
did not stop would keep the process from exiting. Quitting stops the source
and waits at most CLOSE_TIMEOUT_S for it to close its sockets and the run log;
every wait in the source ends well within that, whatever the server does.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from textual.message import Message
from textual.screen import Screen

from kvscope.app.actions import ATTACH_ACTIONS, bindings
from kvscope.app.attach.feed.frame import AttachFrame
from kvscope.app.attach.feed.source import AttachSource
from kvscope.app.attach.window.replay_view import replay_screen_for
from kvscope.app.attach.window.screen import AttachScreen
from kvscope.app.messages import RunLogFailed
from kvscope.app.screens.history import HistoryScreen
from kvscope.app.themed_app import APP_CSS, ThemedApp
from kvscope.settings import settings
from kvscope.themes import THEME_CSS_PATHS

CLOSE_TIMEOUT_S = 1.5
ATTACH_CSS = Path(__file__).with_name("attach.tcss")


@dataclass
class FrameArrived(Message):
    """A frame from the data source thread (posted, never waited on)."""

    frame: AttachFrame


class AttachApp(ThemedApp):
    TITLE = "kvscope attach"
    CSS_PATH = [APP_CSS, ATTACH_CSS, *THEME_CSS_PATHS]
    BINDINGS = bindings(*ATTACH_ACTIONS)

    def __init__(self, source: AttachSource, first_sample=None, *, db_path: str | Path | None = None,
                 screenshot_dir: str | Path | None = None, run_thread: bool = True,
                 log_warning: str | None = None) -> None:
        super().__init__()
        self.log_warning = log_warning  # why the run log is off, when it is
        self._source_started = False
        self.source = source
        self.first_sample = first_sample
        self.db_path = Path(db_path) if db_path else settings().db_path
        self.screenshot_dir = Path(screenshot_dir or os.getcwd())
        self.run_thread = run_thread
        source.publish = self._from_source
        self.view = AttachScreen(source.server.url, len(source.pools.views(0, None)))

    def get_default_screen(self) -> Screen:
        return self.view

    def on_ready(self) -> None:
        if self.log_warning:
            self.notify(self.log_warning, title="Run log", severity="warning", timeout=12)
        if self.run_thread:
            self._source_started = True
            threading.Thread(target=self.source.run, args=(self.first_sample,), name="kvscope-attach",
                             daemon=True).start()

    def on_unmount(self) -> None:
        self.source.stop()
        if self._source_started:
            # The session's run is marked finished once the thread has flushed and closed the log.
            self.source.finished.wait(CLOSE_TIMEOUT_S)

    @property
    def source_running(self) -> bool:
        return self._source_started and not self.source.finished.is_set()

    def on_run_log_failed(self, message: RunLogFailed) -> None:
        self.notify(message.warning, title="Run log", severity="warning", timeout=30)

    def _from_source(self, frame: AttachFrame) -> None:
        self.post_message(FrameArrived(frame))

    def on_frame_arrived(self, message: FrameArrived) -> None:
        self.view.show_frame(message.frame)

    def action_history(self) -> None:
        if not isinstance(self.screen, HistoryScreen):
            self.push_screen(HistoryScreen(self.db_path, replay_for=replay_screen_for))

