"""The KV-event publishers: what each sent, what went wrong, and what the window noticed.

A server without events gets the vLLM flags that turn them on instead. Endpoints,
event kinds and notices quote the server: each is escaped (app/safe_text.py).
"""

from __future__ import annotations

import time

from kvscope.app.attach.feed.frame import AttachFrame
from kvscope.app.attach.feed.groups import NO_GROUP_NOTE
from kvscope.app.attach.feed.pool_view import PoolView
from kvscope.app.attach.feed.subscriber import StreamStatus
from kvscope.app.safe_text import escape, one_line
from kvscope.app.widgets.line_panel import LinePanel

KINDS_SHOWN = 4     # unknown event kinds named in the panel; the rest are "and N more"
GROUPS_SHOWN = 6    # KV-cache groups named on their line (Gemma 3 has six)


def describe_stream(stream: StreamStatus) -> str:
    head = f"[b]{escape(one_line(stream.endpoint, 80))}[/]" + (
        f" [dim](replay {escape(one_line(stream.replay, 80))})[/]" if stream.replay
        else " [dim](no replay endpoint: gaps cannot be filled)[/]")
    if stream.error:
        return f"{head}\n[$error]{escape(one_line(stream.error, 200))}[/]"
    replay = _describe_replay(stream)
    if stream.last_seq is None:
        return f"{head}\n[dim]no events yet (vLLM sends them when a block fills or is evicted)[/]" + replay
    lines = [head, f"seq {stream.first_seq:,}–{stream.last_seq:,} · {stream.num_batches:,} batches · "
                   f"{stream.num_events:,} events · {stream.num_replayed:,} by replay"]
    faults = [f"{stream.num_gaps:,} gaps", f"{stream.num_lost:,} lost", f"{stream.num_malformed:,} malformed",
              f"{stream.num_restarts:,} restarts"]
    if stream.num_reopened:
        faults.append(f"{stream.num_reopened:,} links reopened")
    unknown = describe_unknown(stream)
    if unknown:
        faults.append(unknown)
    bad = stream.num_lost or stream.num_malformed or stream.unknown_kinds
    lines.append(("[$warning]" if bad else "[dim]") + " · ".join(faults) + "[/]")
    if stream.first_seq:
        lines.append(f"[dim]batches before seq {stream.first_seq:,} were gone from the server's buffer[/]")
    return "\n".join(lines) + replay


def describe_unknown(stream: StreamStatus) -> str:
    """The most frequent unknown event kinds, and how many more: a table a server cannot make long."""
    shown = ", ".join(f"{escape(one_line(kind, 40))} ×{count:,}" for kind, count in stream.unknown_kinds[:KINDS_SHOWN])
    if not shown:
        return ""
    more_kinds = len(stream.unknown_kinds) - KINDS_SHOWN + stream.num_other_kinds
    more_events = sum(count for _, count in stream.unknown_kinds[KINDS_SHOWN:]) + stream.num_other_unknown
    more = f" and {more_kinds:,} more kinds ({more_events:,} events)" if more_kinds > 0 else ""
    return f"unknown kinds: {shown}{more}"


def describe_groups(pool: PoolView, name_pool: bool) -> str:
    """One line: the KV-cache groups the events name and the blocks each holds, or that they name none."""
    where = f"{escape(one_line(pool.label, 60))}: " if name_pool else ""
    if not pool.groups_named:
        return f"[dim]{where}{NO_GROUP_NOTE}[/]"
    groups = " · ".join(f"{group.index} {escape(one_line(group.name, 40))} {group.num_blocks:,}"
                        for group in pool.groups[:GROUPS_SHOWN])
    more = f" · and {len(pool.groups) - GROUPS_SHOWN:,} more" if len(pool.groups) > GROUPS_SHOWN else ""
    return f"{where}KV-cache groups (blocks announced): {groups}{more}"


def _describe_replay(stream: StreamStatus) -> str:
    lines = []
    if stream.replaying:
        lines.append("[dim]replaying what the server buffered…[/]")
    if stream.replay_problem:
        lines.append(f"[$warning]{escape(one_line(stream.replay_problem, 160))}[/]")
    return "".join(f"\n{line}" for line in lines)


def describe_events(frame: AttachFrame) -> str:
    if not frame.has_events:
        lines = ["[b $warning]No KV-cache events: the map shows only what /metrics says.[/]",
                 escape(one_line(frame.server.events_note))]
    else:
        lines = [describe_stream(stream) for stream in frame.streams]
        lines.extend(describe_groups(pool, len(frame.pools) > 1) for pool in frame.pools if pool.num_known_blocks)
    for notice in reversed(frame.notices):
        lines.append(f"[dim]{time.strftime('%H:%M:%S', time.localtime(notice.time))}[/] "
                     f"{escape(one_line(notice.text, 300))}")
    return "\n".join(lines)


class EventsPanel(LinePanel):
    PLACEHOLDER = "waiting for the server…"

    def show_frame(self, frame: AttachFrame) -> None:
        self.show(describe_events(frame))
