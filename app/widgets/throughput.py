"""Prompt and generation tokens/s, step latency and KV usage over a rolling window of steps.

One line-API widget draws all four series, one line each: label, current value,
sparkline. A rate is the mean of the latest steps, and zero once a step leaves the
engine with nothing to run: an idle engine produces nothing, whatever its last
steps did. KV use is the latest step's, as the counters show it.

Built from stock labels and sparklines the panel was sixteen widgets,
and every frame paid a full Textual pass for each of them (the sparklines also
blend a colour per bar per frame); here a frame rebuilds only the lines whose
text or bars changed, from styles made once per theme.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style
from textual.color import Color
from textual.events import Resize
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from kvscope.app.widgets.formatting import compact
from kvscope.app.widgets.line_cache import LineCache
from kvscope.app.widgets.theme_styled import ThemeStyled
from kvscope.engine.outputs import StepStats

WINDOW = 120
LABEL_WIDTH = 9
VALUE_WIDTH = 12   # right-aligned, then one space before the sparkline
RECENT = 8         # the value shown is the mean of this many latest steps
BARS = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Series:
    key: str
    label: str
    unit: str
    rate: bool = False      # a rate falls to zero when idle
    latest: bool = False    # a level: show the newest value, not a mean
    ceiling: float | None = None    # a share: bars scale to this (100%), not to the window's peak

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
    Series("prompt_tokens_per_s", "prompt", "tok/s", rate=True),
    Series("generation_tokens_per_s", "generate", "tok/s", rate=True),
    Series("latency", "step", "ms"),
    Series("kv", "KV use", "%", latest=True, ceiling=100.0),
)


def bar_levels(values: list[float], width: int, ceiling: float | None = None) -> tuple[int, ...]:
    """One bar height (0..7) per column, newest on the right, scaled from zero to the window's peak (or to
    ``ceiling``, for a share: 0.17% of the KV cache is no full-height bar).

    With more steps than columns, a column shows the largest of the steps it covers, so a
    spike is never averaged away; with fewer, the bars fill in from the right.
    """
    if width <= 0 or not values:
        return ()
    per_column = -(-len(values) // width)
    columns = [max(values[max(end - per_column, 0):end]) for end in range(len(values), 0, -per_column)]
    columns.reverse()
    peak = ceiling or max(columns)
    if peak <= 0:
        return (0,) * len(columns)
    top = len(BARS) - 1
    return tuple(min(top, max(0, int(value / peak * top + 0.5))) for value in columns)


class Throughput(ThemeStyled, Widget):
    """``push`` every step (cheap: appends to deques); ``redraw`` when the screen paints."""

    COMPONENT_CLASSES = {"throughput--label", "throughput--low", "throughput--high"}

    def __init__(self, *, window: int = WINDOW, series: tuple[Series, ...] = SERIES, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.series = series   # what to plot; the attached window plots a vLLM server's own figures
        self.history = {s.key: deque(maxlen=window) for s in series}
        self.idle = False
        self._dirty = False
        self._rows: list[tuple[str, tuple[int, ...]] | None] = [None] * len(series)
        self._lines: LineCache[int] = LineCache(self._render_row)
        self._styles: tuple[Style, Style, tuple[Style, ...]] | None = None

    # --- data --------------------------------------------------------------------------------

    def push(self, stats: StepStats) -> None:
        for series in self.series:
            self.history[series.key].append(series.value(stats))
        self.idle = not (stats.num_running or stats.num_waiting or stats.num_swapped)
        self._dirty = True

    def clear(self) -> None:
        for values in self.history.values():
            values.clear()
        self._dirty = True
        self.redraw()

    def current(self, key: str) -> float:
        """The value a series shows: the mean of its latest steps, the newest level, or zero when idle."""
        series = next(s for s in self.series if s.key == key)
        values = self.history[key]
        if series.rate and self.idle or not values:
            return 0.0
        if series.latest:
            return values[-1]
        recent = [values[i] for i in range(max(len(values) - RECENT, 0), len(values))]
        return sum(recent) / len(recent)

    def redraw(self) -> None:
        """Repaint the lines whose value or bars changed since the last redraw."""
        if not self._dirty or not self.is_mounted:
            return
        self._dirty = False
        width = self._spark_width
        for y, series in enumerate(self.series):
            row = (series.format(self.current(series.key)),
                   bar_levels(list(self.history[series.key]), width, series.ceiling))
            if row != self._rows[y]:
                self._rows[y] = row
                self._lines.drop(y)
                self.refresh(Region(0, y, self.size.width, 1))

    # --- drawing -------------------------------------------------------------------------------

    @property
    def _spark_width(self) -> int:
        return max(self.size.width - LABEL_WIDTH - VALUE_WIDTH - 1, 0)

    def on_resize(self, event: Resize) -> None:
        self._forget()
        self._dirty = True
        self.redraw()

    def _forget_styles(self) -> None:
        self._styles = None
        self._lines.clear()

    def _forget(self) -> None:
        self._rows = [None] * len(self.series)
        self._lines.clear()

    def _get_styles(self) -> tuple[Style, Style, tuple[Style, ...]]:
        """(label, value, one style per bar height blending low into high), made once per theme."""
        if self._styles is None:
            base = self.rich_style
            # The component's rich style resolves alpha and "auto" colours against the background.
            label, low, high = (self.get_component_rich_style(name).color
                                for name in ("throughput--label", "throughput--low", "throughput--high"))
            low, high = Color.from_rich_color(low), Color.from_rich_color(high)
            top = len(BARS) - 1
            bars = tuple(Style(color=low.blend(high, level / top).rich_color, bgcolor=base.bgcolor)
                         for level in range(len(BARS)))
            self._styles = (Style(color=label, bgcolor=base.bgcolor), base, bars)
        return self._styles

    def render_line(self, y: int) -> Strip:
        return self._lines.line(y)

    def _render_row(self, y: int) -> Strip:
        width = self.size.width
        if y >= len(self.series) or self._rows[y] is None:
            return Strip.blank(width, self.rich_style)
        label_style, value_style, bar_styles = self._get_styles()
        text, levels = self._rows[y]
        segments = [Segment(self.series[y].label[:LABEL_WIDTH].ljust(LABEL_WIDTH), label_style),
                    Segment(text[:VALUE_WIDTH].rjust(VALUE_WIDTH) + " ", value_style)]
        blank = self._spark_width - len(levels)
        if blank > 0:
            segments.append(Segment(" " * blank, value_style))
        start = 0
        for i in range(1, len(levels) + 1):
            if i == len(levels) or levels[i] != levels[start]:
                segments.append(Segment(BARS[levels[start]] * (i - start), bar_styles[levels[start]]))
                start = i
        return Strip(segments).crop_extend(0, width, self.rich_style)
