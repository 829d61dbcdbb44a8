"""The App's engine controls: pause, step, the step cap, load presets, restarts with other settings, aborts.

A mixin of KVScopeApp (app/app.py): each action sends the engine thread a command, asking first (the App's
confirm_abort) where it would abort requests in flight.
"""

from __future__ import annotations

import dataclasses

from kvscope.app.widgets.load_generator import LoadGenerator
from kvscope.app.worker.commands import AbortRequest, Rebuild, SetPaused, SetRateCap, StepOnce
from kvscope.engine.config import EngineConfig

RATE_CAPS = (None, 50.0, 20.0, 10.0, 5.0, 2.0, 1.0, 0.5)  # steps per second, fastest first


class EngineControls:
    def action_toggle_pause(self) -> None:
        if self.worker.state.paused:
            self.worker.send(SetPaused(False))
        else:
            self.worker.send(SetPaused(True))

    def action_single_step(self) -> None:
        self.worker.send(StepOnce())

    def _set_cap(self, direction: int) -> None:
        index = RATE_CAPS.index(self.rate_cap) if self.rate_cap in RATE_CAPS else 0
        self.rate_cap = RATE_CAPS[min(max(index + direction, 0), len(RATE_CAPS) - 1)]
        self.worker.send(SetRateCap(self.rate_cap))
        self.notify("no step cap" if self.rate_cap is None else f"at most {self.rate_cap:g} steps/s", timeout=2)

    def action_slower(self) -> None:
        self._set_cap(+1)

    def action_faster(self) -> None:
        self._set_cap(-1)

    def action_launch_preset(self) -> None:
        self.main.query_one(LoadGenerator).launch()

    def send_preset(self, key: str) -> None:
        """Pick ``key`` in the load generator (so F6 sends it again) and send it at its default count."""
        generator = self.main.query_one(LoadGenerator)
        generator.choose(key)
        generator.launch()

    @property
    def running_config(self) -> EngineConfig:
        """The config of the engine now running (the requested one until it has started)."""
        return self.main.engine_info.config if self.main.engine_info else self.config

    def _rebuild(self, **changes) -> None:
        """Restart the engine with ``changes``, asking first while requests are in flight (it aborts them)."""
        what = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in changes.items())
        self.confirm_abort(f"Restart the engine{' with ' + what if what else ''}?", "restarting the engine",
                           lambda aborted: self._restart(changes, what, aborted), yes="restart")

    def _restart(self, changes: dict, what: str, aborted: str | None) -> None:
        config = dataclasses.replace(self.running_config, **changes)
        self.config = config
        self.worker.send(Rebuild(config))
        said = [what or "restarting"] + ([f"{aborted} aborted"] if aborted else [])
        self.notify(" · ".join(said), title="Restarting the engine", timeout=5)

    def action_toggle_preemption(self) -> None:
        current = self.running_config.preemption_mode
        self._rebuild(preemption_mode="swap" if current == "recompute" else "recompute")

    def action_toggle_prefix_caching(self) -> None:
        current = self.running_config.enable_prefix_caching
        self._rebuild(enable_prefix_caching=not current)

    def action_toggle_allocator(self) -> None:
        current = self.running_config.allocator
        self._rebuild(allocator="contiguous" if current == "paged" else "paged")

    def action_restart_engine(self) -> None:
        self._rebuild()

    def action_abort_reply(self) -> None:
        """Stop the chat's reply in flight (Ctrl+G, from any panel); nothing when none streams."""
        request_id = self.main.abort_chat()
        if request_id is not None:
            self.worker.send(AbortRequest(request_id))

    def action_new_conversation(self) -> None:
        request_id = self.main.new_conversation()
        if request_id is not None:
            self.worker.send(AbortRequest(request_id))

    def action_abort_all(self) -> None:
        for request_id in self.main.requests_in_flight():
            self.worker.send(AbortRequest(request_id))
