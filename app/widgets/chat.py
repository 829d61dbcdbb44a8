"""The chat pane: multi-turn chat through the model's chat template, streamed token by token.

The pane keeps the conversation and the id of the reply in flight; the app sends
each turn to the engine and feeds the outputs back. Every turn resends the whole
conversation, so the second turn's prompt starts with the first turn's tokens
and the prefix cache hands back their blocks. "New conversation" forgets it:
the next turn is sent alone. Ctrl+G stops the reply streaming; Esc only leaves
the input, as it steps out everywhere else.
"""

from __future__ import annotations

import itertools

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.reactive import reactive
from textual.widgets import Input, Static

from kvscope.app.messages import ChatSubmitted
from kvscope.app.widgets.chat_input import ChatInput
from kvscope.engine.config import SamplingParams, model_sampling
from kvscope.engine.outputs import RequestOutput

PLACEHOLDER = "Ask the model…  (? keys · Esc leaves the input · F10 quits)"
DEFAULT_MAX_TOKENS = 256
WAITING = "waiting for the engine…"
SPEAKERS = {"user": "you", "assistant": "assistant"}
HINT = ("Type a question below and press Enter. Its blocks light up in the map while the reply streams; "
        "Ctrl+G stops the reply, Ctrl+N starts a new conversation, Esc leaves the input.")


# The knobs the border names when they differ from SamplingParams' own defaults (which turn each off); greedy
# ignores those in SAMPLING_ONLY, so the border leaves them out then.
KNOBS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
SAMPLING_ONLY = {"top_p", "top_k", "min_p"}
_OFF = SamplingParams()


class ChatPane(Vertical):
    # Esc means one thing here, as everywhere: step out (of the input, to the map). Stopping a reply is the App's
    # Ctrl+G, which works from any panel.
    BINDINGS = [Binding("escape", "screen.leave_chat", "Leave input")]
    # The reply in flight; bindings=True so the footer's "Stop reply" shows exactly while one streams.
    current_request: reactive[str | None] = reactive(None, bindings=True)

    def __init__(self, *, max_tokens: int = DEFAULT_MAX_TOKENS, sampling: tuple[tuple[str, float | int], ...] = (),
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.max_tokens = max_tokens
        self.sampling = sampling    # the knobs typed on the command line, over the model's defaults
        self.messages: list[dict] = []
        self._reply = ""
        self._reply_bubble: Static | None = None
        self._turns = itertools.count(1)
        # Until the engine is ready (the model loads, a rebuild), a question waits in the engine
        # thread's queue and is answered once it is; the bubble says so meanwhile.
        self.engine_waiting = True

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="chat-log"):
            yield Static(HINT, classes="chat-hint")
        chat_input = ChatInput(placeholder=PLACEHOLDER, id="chat-input")
        # The input has the focus most of the time: a blinking cursor would repaint twice a second,
        # a repaint pass the engine pays for under load.
        chat_input.cursor_blink = False
        yield chat_input
        yield Static("", id="paste-note")

    def on_input_changed(self, event: Input.Changed) -> None:
        """The paste note follows the input: shown while a paste marker is in it, gone with the last one."""
        chat_input = self.query_one("#chat-input", ChatInput)
        if event.input is chat_input:
            note = self.query_one("#paste-note", Static)
            summary = chat_input.summary()
            note.update(Content(summary))
            note.display = bool(summary)

    @property
    def chat_log(self) -> VerticalScroll:
        return self.query_one("#chat-log", VerticalScroll)

    def _bubble(self, text: str, kind: str) -> Static:
        role = kind.split()[0]
        bubble = Static(Content(text), classes=f"bubble {kind}")
        bubble.border_title = SPEAKERS.get(role, role)
        self.chat_log.mount(bubble)
        self.chat_log.scroll_end(animate=False)
        return bubble

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        chat_input = self.query_one("#chat-input", ChatInput)
        text = chat_input.expanded(event.value).strip()     # a multi-line paste whole, not its marker
        if not text:
            event.input.value = ""   # whitespace alone is nothing to send, and nothing to keep
            return
        if self.current_request is not None:
            self.notify("A reply is still streaming; Ctrl+G stops it.", severity="warning")
            return
        event.input.value = ""
        chat_input.clear_pastes()
        self.chat_log.query(".chat-hint").remove()
        self.messages.append({"role": "user", "content": text})
        self._bubble(text, "user")
        self._reply = ""
        self._reply_bubble = self._bubble(WAITING if self.engine_waiting else "…", "assistant streaming")
        self.current_request = f"chat-{next(self._turns)}"
        self.post_message(ChatSubmitted(self.current_request, tuple(self.messages), self.max_tokens))

    def show_output(self, output: RequestOutput) -> None:
        if output.request_id != self.current_request:
            return
        if output.text_delta:
            self._reply += output.text_delta
            self._reply_bubble.update(Content(self._reply))
            self.chat_log.scroll_end(animate=False)
        if output.finished:
            self._finish(output)

    def show_sampling(self, defaults: tuple[tuple[str, float | int], ...]) -> None:
        """Say on the pane's border how replies are sampled: the model's own generation_config, as vLLM and
        `kvscope chat` take it (greedy for SmolLM2), under the knobs typed on the command line."""
        params = model_sampling(defaults, **dict(self.sampling))
        how = ["greedy" if params.temperature == 0.0 else f"temperature {params.temperature:g}"]
        how += [f"{name} {getattr(params, name):g}" for name in KNOBS
                if getattr(params, name) != getattr(_OFF, name)
                and (params.temperature != 0.0 or name not in SAMPLING_ONLY)]
        self.border_subtitle = f"{', '.join(how)} · {'flags' if self.sampling else 'generation_config'}"

    def set_engine_waiting(self, waiting: bool) -> None:
        self.engine_waiting = waiting
        if self.current_request is not None and not self._reply:
            self._reply_bubble.update(Content(WAITING if waiting else "…"))

    def _finish(self, output: RequestOutput) -> None:
        bubble = self._reply_bubble
        bubble.remove_class("streaming")
        if output.finish_reason == "error":
            self._fail(output.error or "the engine could not finish this reply")
            return
        if output.finish_reason == "abort" and output.error:   # aborted by the app (a rebuild), not the user
            self._fail(f"{output.error}; ask again")
            return
        text = output.text or self._reply
        note = {"abort": " [aborted]", "length": " [max tokens]"}.get(output.finish_reason or "", "")
        bubble.update(Content(text + note))
        if text:
            self.messages.append({"role": "assistant", "content": text})
        self.current_request = None

    def _fail(self, error: str) -> None:
        """The turn never ran (or died): show why, and take the question out of the conversation."""
        self._reply_bubble.remove_class("streaming")
        self._reply_bubble.add_class("error")
        self._reply_bubble.update(Content(f"⚠ {error}"))
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        self.current_request = None

    def abort(self) -> str | None:
        """Stop showing the reply in flight at once; returns its request id for the engine to abort."""
        request_id = self.current_request
        if request_id is not None:
            self._reply_bubble.remove_class("streaming")
            self._reply_bubble.update(Content(self._reply + " [aborted]"))
            if self._reply:
                self.messages.append({"role": "assistant", "content": self._reply})
            self.current_request = None
        return request_id

    def new_conversation(self) -> str | None:
        """Forget every turn (the next one is sent alone) and clear the log; returns a reply in flight to abort."""
        request_id = self.abort()
        self.messages.clear()
        self.chat_log.remove_children()
        self.chat_log.mount(Static("New conversation: the model sees none of the earlier turns.",
                                   classes="chat-hint"))
        return request_id

    def show_rejection(self, request_id: str, error: str) -> None:
        if request_id == self.current_request:
            self._fail(error)
