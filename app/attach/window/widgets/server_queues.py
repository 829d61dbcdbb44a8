"""Running and waiting, by reason, with their recent history; and in words what the server does not expose."""

from __future__ import annotations

from kvscope.app.attach.feed.frame import AttachFrame
from kvscope.app.attach.feed.server import ServerInfo
from kvscope.app.safe_text import escape, one_line
from kvscope.app.widgets.line_panel import LinePanel
from kvscope.app.widgets.throughput import BARS, bar_levels

SPARK_WIDTH = 40
NOT_EXPOSED = ("[dim]vLLM publishes counts, not requests: per-request rows (prompt, progress, block table) "
               "are not exposed. Its V1 scheduler recomputes a preempted request instead of swapping it out, "
               "so there is no swapped queue.[/]")
KVSCOPE_NOT_EXPOSED = ("[dim]kvscope serve publishes vLLM's counts, not requests: per-request rows (prompt, "
                       "progress, block table) are in its own window (kvscope --serve), not here.[/] ")


def not_exposed(server: ServerInfo) -> str:
    """What the server does not publish, and whether it has a swapped queue, worded for the kind it is."""
    if not server.is_kvscope:
        return NOT_EXPOSED
    if server.swap_blocks:
        return KVSCOPE_NOT_EXPOSED + (f"[dim]It swaps preempted requests to a host pool of {server.swap_blocks:,} "
                                      "blocks; this window does not chart its swapped queue.[/]")
    return KVSCOPE_NOT_EXPOSED + "[dim]It recomputes preempted requests (recompute mode): no swapped queue.[/]"


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    return "".join(BARS[level] for level in bar_levels(values, width))


def describe_reasons(counts: tuple[tuple[str, int], ...], number: str) -> str:
    """Label counts as the server named them (escaped; metrics.py already capped how many)."""
    return " · ".join(f"{escape(one_line(label, 40))} {number.format(count)}" for label, count in counts)


def describe_queues(frame: AttachFrame) -> str:
    history = frame.queue_history
    if not history:
        return "waiting for the first /metrics sample…\n" + not_exposed(frame.server)
    now = history[-1]
    reasons = describe_reasons(now.waiting_by_reason, "{:}") or "no reasons published"
    lines = [
        f"running {now.num_running:>4}  [$success]{sparkline([p.num_running for p in history])}[/]",
        f"waiting {now.num_waiting:>4}  [$warning]{sparkline([p.num_waiting for p in history])}[/]",
        f"[dim]waiting by reason:[/] {reasons}",
    ]
    if frame.metrics is not None:
        finished = frame.metrics.totals().finished_by_reason
        if finished:
            lines.append("[dim]finished since start:[/] " + describe_reasons(finished, "{:,}"))
    lines.append(f"[dim]last {len(history)} samples, {history[-1].time - history[0].time:.0f} s[/]")
    return "\n".join(lines + [not_exposed(frame.server)])


class ServerQueues(LinePanel):
    PLACEHOLDER = "waiting for the server…"

    def show_frame(self, frame: AttachFrame) -> None:
        if frame.queue_history:
            now = frame.queue_history[-1]
            self.border_title = f"Queues · running {now.num_running} · waiting {now.num_waiting}"
        self.show(describe_queues(frame))
