"""Prompt and generation tokens/s, step latency and KV usage over a rolling window of steps."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline

from app.widgets.formatting import compact
from engine.outputs import StepStats

WINDOW = 120


@dataclass(frozen=True)
class Series:
    key: str
    label: str
    unit: str

    def format(self, value: float) -> str:
        if self.unit == "ms" and value >= 1000:
            return f"{value / 1000:.1f} s"
        return f"{compact(value)} {self.unit}"

    def value(self, stats: StepStats) -> float:
        if self.key == "latency":
            return stats.duration * 1000
        if self.key == "kv":
            return stats.kv_usage * 100
        return getattr(stats, self.key)


SERIES = (
    Series("prompt_tokens_per_s", "prompt", "tok/s"),
    Series("generation_tokens_per_s", "generate", "tok/s"),
    Series("latency", "step", "ms"),
    Series("kv", "KV use", "%"),
)


class Throughput(Vertical):
    """``push`` every step (cheap: appends to deques); ``redraw`` when the screen paints."""

    def __init__(self, *, window: int = WINDOW, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.history = {series.key: deque(maxlen=window) for series in SERIES}
        self._dirty = False

    def compose(self) -> ComposeResult:
        for series in SERIES:
            with Horizontal(classes="series"):
                yield Label(series.label, classes="series-label")
                yield Label("", id=f"value-{series.key}", classes="series-value")
                yield Sparkline([], id=f"spark-{series.key}", classes=f"series-{series.key}")

    def push(self, stats: StepStats) -> None:
        for series in SERIES:
            self.history[series.key].append(series.value(stats))
        self._dirty = True

    def clear(self) -> None:
        for values in self.history.values():
            values.clear()
        self._dirty = True
        self.redraw()

    def load(self, stats: list[StepStats]) -> None:
        """Replace the window with a recorded run's steps."""
        for values in self.history.values():
            values.clear()
        for item in stats:
            self.push(item)
        self.redraw()

    def redraw(self) -> None:
        if not self._dirty or not self.is_mounted:
            return
        self._dirty = False
        for series in SERIES:
            values = self.history[series.key]
            recent = list(values)[-8:]
            current = sum(recent) / len(recent) if recent else 0.0
            label = self.query_one(f"#value-{series.key}", Label)
            label.update(series.format(current), layout=False)
            self.query_one(f"#spark-{series.key}", Sparkline).data = list(values)
