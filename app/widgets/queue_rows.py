"""What a row of the queues panel says: its cells, their columns and widths, and a finished request's reason.

Pure functions over the engine's RequestView and events, apart from the widget that draws them (queues.py),
so the replay, the tests and the widget read one definition of each column.
"""

from __future__ import annotations

from typing import NamedTuple

from kvscope.engine.outputs import EngineEvent, EventKind, RequestView

QUEUE_ORDER = {"running": 0, "swapped": 1, "waiting": 2}
# queue -> (label, theme variable of its colour, dim)
QUEUE_LABELS = {"running": ("▶ run", "success", False), "swapped": ("⇄ swap", "warning", False),
                "waiting": ("… wait", "foreground", True)}
FINISHED_LABELS = {"stop": "✓ stop", "length": "✓ length", "abort": "✗ abort", "error": "✗ error"}
FINISHED = "finished"
FINISHED_KEEP_STEPS = 30
FINISHED_MAX_ROWS = 8
# (header, minimum width, right-aligned); the prompt column takes whatever width is left
COLUMNS = (("request", 8, False), ("queue", 9, False), ("prompt", 0, False), ("prefill", 8, True),
           ("output", 7, True), ("blocks", 7, True), ("cached", 7, True), ("preempt", 8, True))
PROMPT_COLUMN = 2
MIN_PROMPT_WIDTH = 8
# The columns a narrow table leaves out, first to last.
DROP_ORDER = tuple(next(i for i, (header, _, _) in enumerate(COLUMNS) if header == name)
                   for name in ("prompt", "cached", "preempt", "prefill"))
# How a finished request's reason is read from a step's events.
_EVENT_REASONS = {EventKind.ABORT: "abort", EventKind.ERROR: "error"}


class RequestFinal(NamedTuple):
    """How a request ended: from its final output (live) or the run log's requests table (replay)."""

    num_output_tokens: int
    num_preemptions: int
    num_cached_tokens: int
    finish_reason: str | None


def row_cells(view: RequestView) -> tuple[str, ...]:
    """The row of one request; compared with the previous row so unchanged rows keep their Strip."""
    tables = view.block_tables
    # One table never holds a block twice; samples of one request share theirs, counted once.
    device_blocks = len(tables[0]) if len(tables) == 1 else len({b for table in tables for b in table})
    host_blocks = sum(len(t) for t in view.host_block_tables)
    samples = f"×{view.num_samples} " if view.num_samples > 1 else ""
    return (
        view.request_id,
        view.queue,
        view.prompt_preview.replace("\n", " "),
        f"{min(view.num_computed_tokens, view.num_prompt_tokens)}/{view.num_prompt_tokens}",
        f"{samples}{view.num_output_tokens}/{view.max_tokens}",
        f"{device_blocks}" + (f"+{host_blocks}h" if host_blocks else ""),
        str(view.num_cached_tokens),
        str(view.num_preemptions),
    )


def finished_reasons(events: tuple[EngineEvent, ...]) -> dict[str, str]:
    """request id -> finish reason, for the requests a step's events say ended."""
    reasons = {}
    for event in events:
        if event.kind == EventKind.FINISH and event.request_id:
            reasons[event.request_id] = event.detail or "stop"
        elif event.kind in _EVENT_REASONS and event.request_id:
            reasons[event.request_id] = _EVENT_REASONS[event.kind]
    return reasons


def column_widths(rows: list[tuple[str, ...]]) -> list[int]:
    """Each column's width: its header's or its widest value's, plus one space (prompt: 0, it flexes)."""
    widths = []
    for i, (header, minimum, _) in enumerate(COLUMNS):
        if i == PROMPT_COLUMN:
            widths.append(0)
            continue
        widest = max((len(row[i]) for row in rows), default=0)
        widths.append(max(minimum, len(header) + 1, widest + 1))
    return widths


def _fit(text: str, width: int, right: bool) -> str:
    if len(text) > width - 1:
        text = text[: max(width - 2, 0)] + "…"
    return text.rjust(width - 1) + " " if right else text.ljust(width)
