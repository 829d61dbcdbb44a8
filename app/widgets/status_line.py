"""The vLLM-style status line: the figures vLLM logs every ten seconds, under vLLM's own names.

People who run vLLM read "Avg prompt throughput: … tokens/s, Avg generation
throughput: … tokens/s, Running: N reqs, Waiting: N reqs, GPU KV cache usage: …%,
Prefix cache hit rate: …%" in its log; kvscope says the same things the same
way. The rates are averaged over the last INTERVAL_S seconds of engine time
(the steps' own time stamps, so a replayed or fixed-clock run reads the same),
and are zero once the engine has nothing left to do. The hit rate is
cumulative over the engine's life; vLLM's covers its recent requests.
"""

from __future__ import annotations

from collections import deque

from kvscope.app.status_sentence import status_sentence
from kvscope.app.widgets.line_panel import LinePanel
from kvscope.engine.outputs import CacheSnapshot, StepStats

INTERVAL_S = 10.0   # vLLM logs its stats every 10 s


class RateWindow:
    """Prompt and generated tokens of the steps in the last INTERVAL_S seconds of step time."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._steps: deque[tuple[float, float, int, float]] = deque()  # (end, start, prompt, generated)

    def push(self, stats: StepStats) -> None:
        generated = stats.generation_tokens_per_s * stats.duration
        self._steps.append((stats.time, stats.time - stats.duration, stats.num_prefill_tokens, generated))
        while self._steps and self._steps[0][0] < stats.time - self.interval_s:
            self._steps.popleft()

    def clear(self) -> None:
        self._steps.clear()

    def rates(self) -> tuple[float, float]:
        """(prompt, generation) tokens per second over the window, or over what is seen of it so far."""
        if not self._steps:
            return 0.0, 0.0
        end = self._steps[-1][0]
        span = min(self.interval_s, end - min(start for _, start, _, _ in self._steps))
        if span <= 0:
            return 0.0, 0.0
        return sum(s[2] for s in self._steps) / span, sum(s[3] for s in self._steps) / span


def describe_status(prompt_rate: float, generation_rate: float, snapshot: CacheSnapshot, stats: StepStats,
                    device: str) -> str:
    """The line, as vLLM's logger words it ("GPU KV cache usage" on CUDA; "CPU KV cache usage" otherwise,
    as vLLM's CPU build says)."""
    queues = [view.queue for view in snapshot.requests]
    hits = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    return status_sentence(prompt_rate, generation_rate, queues.count("running"), queues.count("waiting"),
                           queues.count("swapped") or None, device, stats.kv_usage, hits, grouped=True)


class VllmStatusLine(LinePanel):
    """``push`` every step's stats; ``show_status`` when the screen draws its panels of numbers. Lines that show
    the same engine in two places share one ``window`` (push to one of them) and one ``status_text``."""

    def __init__(self, *, id: str | None = None, classes: str | None = None,
                 window: RateWindow | None = None) -> None:
        super().__init__("", id=id, classes=classes)
        self.window = window if window is not None else RateWindow()
        self.device = "cpu"

    def push(self, stats: StepStats) -> None:
        self.window.push(stats)

    def reset(self, device: str) -> None:
        self.device = device
        self.window.clear()
        self.show("")

    def status_text(self, snapshot: CacheSnapshot, stats: StepStats) -> str:
        idle = not snapshot.requests
        prompt, generation = (0.0, 0.0) if idle else self.window.rates()
        return describe_status(prompt, generation, snapshot, stats, self.device)

    def show_status(self, snapshot: CacheSnapshot, stats: StepStats) -> None:
        self.show(self.status_text(snapshot, stats))
