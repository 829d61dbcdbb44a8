"""The engine thread's request commands: adding a request, a chat turn or a load, and aborting one.

A mixin of EngineWorker (app/worker/thread.py), kept apart because it is the one part that talks about single
requests; the thread's loop, stepping and engine lifecycle stay there. Runs on the engine thread only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvscope.app.load import presets
from kvscope.app.messages import CommandRejected, RequestRejected
from kvscope.app.worker.commands import AddRequest
from kvscope.engine.config import RequestError, SamplingParams


def describe_error(exc: BaseException) -> str:
    """A refusal (RequestError) in its own words; anything else, which is a bug, with its type."""
    return str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"


class RequestCommands:
    """What EngineWorker does with AddRequest, AddChatTurn, AbortRequest, LaunchPreset and LaunchPlan."""

    def _add(self, request: AddRequest) -> None:
        if self.engine is None:
            self._post(RequestRejected(request.request_id, "the engine is not running"))
            return
        try:
            request_id = self.engine.add_request(request.prompt, request.params, request_id=request.request_id)
        except Exception as exc:    # a refusal, or an engine bug: either way this request only
            self._reject(request.request_id, exc)
            return
        self._accepted.add(request_id)
        self._queued = True

    def _reject(self, request_id: str, exc: BaseException) -> None:
        self._post(RequestRejected(request_id, describe_error(exc)))

    def _abort(self, request_id: str) -> None:
        if self.engine is None:
            return
        self._delayed.drop(request_id)
        # The engine reports an abort with its next step: make sure one runs, even with nothing
        # else left to do (a paused engine reports it when the user steps or resumes).
        self._abort_unreported |= self.engine.abort_request(request_id)

    def _add_chat_turn(self, request_id: str, messages: tuple[dict, ...], params: SamplingParams) -> None:
        """The reply is as long as the chat pane asks, or what is left after the prompt (the engine's rule)."""
        try:    # the chat template, applied once: add_request takes the tokenized prompt as is
            prompt = self.engine.tokenize(list(messages)) if self.engine is not None else list(messages)
        except Exception as exc:
            return self._reject(request_id, exc)
        if self.engine is not None:
            room = max(1, self.engine.reply_room(len(prompt.token_ids), params.n))
            params = dataclasses.replace(params, max_tokens=min(params.max_tokens or room, room))
        self._add(AddRequest(request_id, prompt, params))
        if request_id in self._accepted:
            self._watch(request_id)     # the chat streams its text: every step's output reaches the UI

    def _launch_preset(self, key: str, count: int) -> None:
        self._launch("LaunchPreset", lambda context: presets.build(key, count, context),
                     lambda item: f"{key}-{next(self._ids)}")

    def _launch_plan(self, plan: Callable) -> None:
        self._launch("LaunchPlan", plan, lambda item: item.name or f"load-{next(self._ids)}")

    def _launch(self, command_name: str, make_plan: Callable, name: Callable) -> None:
        if self.engine is None:
            return
        try:
            planned = make_plan(presets.PresetContext.from_engine(self.engine))
        except ValueError as exc:   # the load cannot fit this pool: a refusal in its own words, with the fix
            self._post(CommandRejected(command_name, str(exc)))
            return
        for item in planned:
            request = AddRequest(name(item), item.prompt, item.params)
            if item.delay_steps:
                self._delayed.push(self._steps_done + item.delay_steps, request)
            else:
                self._add(request)
