"""The App's lessons: the list (L), starting one on its own engine and teaching pool, and coming back.

A mixin of KVScopeApp (app/app.py), which holds the engine worker, the live screen and the run log settings
these use.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvscope.app.lessons import LESSONS
from kvscope.app.lessons.load import teach_config
from kvscope.app.screens.lesson import LessonScreen
from kvscope.app.screens.lesson_menu import LessonMenu
from kvscope.app.worker.commands import Rebuild, SetPaused, SetRateCap, SetRunLog


class LessonControls:
    def action_lessons(self) -> None:
        if not isinstance(self.screen, (LessonMenu, LessonScreen)):
            self.push_screen(LessonMenu(), lambda name: name and self.start_lesson(name))

    def start_lesson(self, name: str) -> None:
        """Run a lesson on a fresh engine with the teaching pool; Esc in it comes back here. Asks first when it
        would abort the app's requests in flight (a lesson's own go with it without a word). A lesson that runs
        on a model offered by name which is not fetched yet says how to fetch it, in one line, and starts not."""
        model = LESSONS[name].config.get("model")
        if model and (hint := self.fetch_hint(model)) is not None:
            self.notify(hint, title=f"Lesson {name} runs on {model}", severity="error", timeout=20)
            return
        if self.lesson_screen is not None:
            self._start_lesson(name)
            return
        self.confirm_abort(f"Start the lesson {name}?", "starting a lesson on its own engine",
                           lambda aborted: self._start_lesson(name, aborted), yes="start it")

    def _start_lesson(self, name: str, aborted: str | None = None) -> None:
        if self.lesson_screen is not None:
            self.leave_lesson(rebuild=False)
        else:
            self._state_before_lesson = self.worker.state
        if aborted:
            self.notify(f"{aborted} aborted", title=f"Lesson {name}", timeout=5)
        lesson = LESSONS[name]
        self._ensure_run_log()
        self.lesson_screen = LessonScreen(lesson, teach_config(self.config, **lesson.config))
        self.worker.send(SetRunLog(self.run_log_spec()))    # before the lesson's first rebuild
        self.worker.whole_steps = True    # the lesson takes every step's queues and snapshot
        self.push_screen(self.lesson_screen)

    def leave_lesson(self, rebuild: bool = True) -> None:
        screen, self.lesson_screen = self.lesson_screen, None
        self.worker.whole_steps = False
        if screen is not None and screen.is_attached:
            self.pop_screen() if self.screen is screen else screen.dismiss()
        self.worker.send(SetRunLog(self.run_log_spec()))
        if rebuild:
            self.worker.send(Rebuild(self.config))
            before, self._state_before_lesson = self._state_before_lesson, None
            if before is not None:      # the app as it was: a lesson leaves the engine paused, its cap on
                self.rate_cap = before.steps_per_s_cap
                self.worker.send(SetRateCap(before.steps_per_s_cap))
                self.worker.send(SetPaused(before.paused))

    def _ensure_run_log(self) -> None:
        """Lessons go back by replaying the run log: with the log off, they keep one for this session only."""
        if self.log_enabled:
            return
        self._lesson_log_dir = tempfile.TemporaryDirectory(prefix="kvscope-lesson-")
        self.db_path = Path(self._lesson_log_dir.name) / "lessons.db"
        self.log_enabled = True
