"""Load presets with an adjustable count: pick one, set N, launch."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Select, Static

from kvscope.app.load.presets import PRESETS
from kvscope.app.messages import PresetLaunched


class LoadGenerator(Vertical):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.preset_key = next(iter(PRESETS))

    def compose(self) -> ComposeResult:
        yield Select([(p.title, p.key) for p in PRESETS.values()], value=self.preset_key,
                     allow_blank=False, id="preset-select")
        with Horizontal(classes="load-row"):
            yield Input(str(PRESETS[self.preset_key].default_count), type="integer", id="preset-count",
                        tooltip="How many requests (or prompts) the preset sends")
            yield Button("Launch (F6)", id="preset-launch", variant="primary")
        yield Static(PRESETS[self.preset_key].description, id="preset-description")

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        if event.value in PRESETS:
            self.choose(event.value)

    def choose(self, key: str) -> None:
        self.preset_key = key
        preset = PRESETS[key]
        self.query_one("#preset-count", Input).value = str(preset.default_count)
        self.query_one("#preset-description", Static).update(preset.description)
        select = self.query_one("#preset-select", Select)
        if select.value != key:
            select.value = key

    @property
    def count(self) -> int:
        value = self.query_one("#preset-count", Input).value
        if not value.strip().lstrip("-").isdigit():
            return PRESETS[self.preset_key].default_count
        return max(1, int(value))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.launch()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.launch()

    def launch(self) -> None:
        self.post_message(PresetLaunched(self.preset_key, self.count))
