"""The event line under the block map: what the engine did in the step on screen, in words.

A class watching the map sees blocks change colour; this line says why: how many
decodes and prefill chunks ran, which blocks were copied on write, how many
cached blocks were evicted, who was preempted, swapped, admitted or finished.
It is built from the step's own record (stats, events, snapshot), so the replay
narrates a logged step exactly as the live window narrated it. Prefill chunks
and admissions are read off the difference with the step before, when the
caller has it; without it the line gives the prefill token count alone.
"""

from __future__ import annotations

from collections import defaultdict

from textual.markup import escape

from kvscope.app.widgets.line_panel import LinePanel
from kvscope.engine.outputs import CacheSnapshot, EngineEvent, EventKind, StepResult, StepStats

MAX_NAMES = 4           # request ids listed per kind before "+N more"
HINT = "Each step is narrated here once the engine runs."


def _plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def _names(request_ids: list[str]) -> str:
    unique = list(dict.fromkeys(request_ids))
    shown = ", ".join(escape(rid) for rid in unique[:MAX_NAMES])
    return shown + (f" +{len(unique) - MAX_NAMES} more" if len(unique) > MAX_NAMES else "")


def prefill_chunks(snapshot: CacheSnapshot, previous: CacheSnapshot) -> list[tuple[str, int]]:
    """(request id, tokens) of each prompt chunk computed between ``previous`` and ``snapshot``.

    A request was prefilling if, before the step, fewer than all but its newest token were computed
    (a decode computes exactly that one token). Sample 0 stands for a request's samples.
    """
    before = {view.request_id: view for view in previous.requests}
    chunks = []
    for view in snapshot.requests:
        if view.queue != "running":
            continue
        old = before.get(view.request_id)
        start = old.num_computed_tokens if old is not None else 0
        total = (old or view).num_prompt_tokens + (old.num_output_tokens if old is not None else 0)
        if old is None or old.queue == "waiting" and old.num_computed_tokens == 0:
            start = view.num_cached_tokens if view.num_preemptions == 0 else 0
        advanced = view.num_computed_tokens - start
        if advanced > 0 and start < total - 1:
            chunks.append((view.request_id, advanced))
    return chunks


def joined(snapshot: CacheSnapshot, previous: CacheSnapshot) -> list[str]:
    """Requests running now that were waiting (or not yet there) the step before."""
    queues = {view.request_id: view.queue for view in previous.requests}
    return [view.request_id for view in snapshot.requests
            if view.queue == "running" and queues.get(view.request_id, "waiting") == "waiting"]


def readable_previous(previous: StepResult | None) -> CacheSnapshot | None:
    """The snapshot of ``previous`` (the step before the one shown) unless it came thinned, its views left behind
    (app/worker/step_posting.py): a pool with no requests where its stats count some. Read as empty, it named
    every running request as admitted."""
    if previous is None:
        return None
    stats = previous.stats
    if not previous.snapshot.num_requests and (stats.num_running or stats.num_waiting or stats.num_swapped):
        return None
    return previous.snapshot


def _work(stats: StepStats, snapshot: CacheSnapshot, previous: CacheSnapshot | None) -> str:
    parts = []
    if stats.num_decode_tokens:
        parts.append(_plural(stats.num_decode_tokens, "decode"))
    if stats.num_prefill_tokens:
        chunks = prefill_chunks(snapshot, previous) if previous is not None else []
        tokens = _plural(stats.num_prefill_tokens, "token")
        parts.append(f"{_plural(len(chunks), 'prefill chunk')} ({tokens})" if chunks else f"prefill {tokens}")
    return ", ".join(parts) or "no tokens computed"


def _event_parts(events: tuple[EngineEvent, ...]) -> list[str]:
    by_kind: dict[EventKind, list[EngineEvent]] = defaultdict(list)
    for event in events:
        by_kind[event.kind].append(event)
    parts = []
    copies = [f"{e.blocks[0]}→{e.blocks[1]}" for e in by_kind[EventKind.COPY_ON_WRITE] if len(e.blocks) == 2]
    if copies:
        more = f" +{len(copies) - MAX_NAMES} more" if len(copies) > MAX_NAMES else ""
        parts.append("copy-on-write " + ", ".join(copies[:MAX_NAMES]) + more)
    evicted = sum(len(e.blocks) for e in by_kind[EventKind.EVICT])
    if evicted:
        parts.append(f"evicted {_plural(evicted, 'cached block')}")
    recomputed = [e.request_id for e in by_kind[EventKind.PREEMPT] if not e.detail.startswith("swap")]
    if recomputed:
        parts.append(f"preempted {_names(recomputed)} (recompute)")
    for kind, words in ((EventKind.SWAP_OUT, "swapped out"), (EventKind.SWAP_IN, "swapped in"),
                        (EventKind.ABORT, "aborted"), (EventKind.ERROR, "failed")):
        if by_kind[kind]:
            parts.append(f"{words} {_names([e.request_id for e in by_kind[kind]])}")
    if by_kind[EventKind.FINISH]:
        parts.append(f"finished {_names([e.request_id for e in by_kind[EventKind.FINISH]])}")
    return parts


def narrate(stats: StepStats, events: tuple[EngineEvent, ...], snapshot: CacheSnapshot,
            previous: CacheSnapshot | None = None) -> str:
    """Markup: "step 332: 4 decodes, 1 prefill chunk (512 tokens) · copy-on-write 94→78 · …".

    ``previous`` counts only when it is the step just before ``snapshot``'s."""
    if previous is not None and previous.step != snapshot.step - 1:
        previous = None
    parts = [_work(stats, snapshot, previous)]
    admitted = joined(snapshot, previous) if previous is not None else []
    if admitted:
        parts.append(f"admitted {_names(admitted)}")
    parts.extend(_event_parts(events))
    return f"[b]step {stats.step:,}[/b]: " + " · ".join(parts)


class EventLine(LinePanel):
    """One step's narration; wraps rather than cut an id, and scrolls if it must."""

    PLACEHOLDER = HINT

    def show_ready(self, num_blocks: int, block_size: int) -> None:
        self.show(f"[b]ready[/b]: {_plural(num_blocks, 'block')} of {block_size} tokens, every one free")

    def show_step(self, stats: StepStats, events: tuple[EngineEvent, ...], snapshot: CacheSnapshot,
                  previous: CacheSnapshot | None = None) -> None:
        self.show(narrate(stats, events, snapshot, previous))
