"""The KV-event publishers: what each sent, what went wrong, and what the window noticed.

A server without events gets the vLLM flags that turn them on instead.
"""

from __future__ import annotations

import time

from textual.markup import escape

from kvscope.app.attach.feed.frame import AttachFrame
from kvscope.app.attach.feed.subscriber import StreamStatus
from kvscope.app.widgets.line_panel import LinePanel


def describe_stream(stream: StreamStatus) -> str:
    head = f"[b]{escape(stream.endpoint)}[/]" + (f" [dim](replay {escape(stream.replay)})[/]" if stream.replay
                                                else " [dim](no replay endpoint: gaps cannot be filled)[/]")
    if stream.error:
        return f"{head}\n[$error]{escape(stream.error)}[/]"
    if stream.last_seq is None:
        return f"{head}\n[dim]no events yet (vLLM sends them when a block fills or is evicted)[/]"
    lines = [head, f"seq {stream.first_seq:,}–{stream.last_seq:,} · {stream.num_batches:,} batches · "
                   f"{stream.num_events:,} events · {stream.num_replayed:,} by replay"]
    faults = [f"{stream.num_gaps:,} gaps", f"{stream.num_lost:,} lost", f"{stream.num_malformed:,} malformed",
              f"{stream.num_restarts:,} restarts"]
    unknown = ", ".join(f"{kind} ×{count}" for kind, count in stream.unknown_kinds)
    if unknown:
        faults.append(f"unknown kinds: {escape(unknown)}")
    bad = stream.num_lost or stream.num_malformed or stream.unknown_kinds
    lines.append(("[$warning]" if bad else "[dim]") + " · ".join(faults) + "[/]")
    if stream.first_seq:
        lines.append(f"[dim]batches before seq {stream.first_seq:,} were gone from the server's buffer[/]")
    return "\n".join(lines)


def describe_events(frame: AttachFrame) -> str:
    if not frame.has_events:
        lines = ["[b $warning]No KV-cache events: the map shows only what /metrics says.[/]",
                 escape(frame.server.events_note)]
    else:
        lines = [describe_stream(stream) for stream in frame.streams]
    for notice in reversed(frame.notices):
        lines.append(f"[dim]{time.strftime('%H:%M:%S', time.localtime(notice.time))}[/] {escape(notice.text)}")
    return "\n".join(lines)


class EventsPanel(LinePanel):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__("waiting for the server…", id=id, classes=classes)

    def show_frame(self, frame: AttachFrame) -> None:
        self.show(describe_events(frame))
