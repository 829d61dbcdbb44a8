"""Turns what the logger is handed (request arrivals, and what it keeps of each step) into table rows.

Runs on the writer thread, so the engine thread never waits for it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from kvscope.app.runlog.schema import GROUP_COLUMNS, STEP_COLUMNS
from kvscope.app.runlog.snapshots import SnapshotEncoder
from kvscope.engine.outputs import CacheSnapshot, RequestOutput, StepResult, StepStats

# The steps table's columns that are StepStats fields, copied as they are; the rest (run_id, the used blocks) the
# builder fills itself.
_STATS_COLUMNS = tuple(name for name in STEP_COLUMNS if name in {f.name for f in dataclasses.fields(StepStats)}
                       and name not in GROUP_COLUMNS)


@dataclass(frozen=True)
class RequestAdded:
    request_id: str
    prompt_text: str
    num_prompt_tokens: int
    n: int


@dataclass(frozen=True)
class LoggedStep:
    """What the log keeps of a step until its writer takes it: the stats, events and snapshot, and the outputs
    of the requests that finished. Not the step's other outputs (a request each, a step): held for the tenth of
    a second the writer gathers a batch, they outlived the collector's young generation, whose passes then ran
    on the engine thread (+25% a step at 256 requests); the tokens they count are in the stats."""

    stats: StepStats
    events: tuple
    snapshot: CacheSnapshot
    finished: list[RequestOutput]

    @classmethod
    def of(cls, result: StepResult) -> LoggedStep:
        return cls(result.stats, result.events, result.snapshot, result.finished_outputs)


def record_bytes(record: RequestAdded | LoggedStep) -> int:
    """About what a queued record keeps alive: its snapshot's block changes (or whole arrays, where it holds
    them) and a few hundred bytes per request, output and event. An estimate: it bounds the writer's queue."""
    if isinstance(record, RequestAdded):
        return 256 + len(record.prompt_text)
    snapshot = record.snapshot
    return (1024 + snapshot.blocks.held_bytes
            + 256 * (snapshot.num_requests + len(record.finished) + len(record.events)))


@dataclass
class Rows:
    """One batch of rows, written in this field order (a request's arrival before its finish)."""

    added_requests: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    snapshots: list[dict] = field(default_factory=list)
    finished_requests: list[dict] = field(default_factory=list)
    run_update: dict = field(default_factory=dict)


def _num_tokens(output: RequestOutput) -> int:
    if len(output.samples) <= 1:
        return len(output.token_ids)
    return sum(len(s.token_ids) for s in output.samples)


class RowBuilder:
    """Stateful per run: it diffs snapshots and follows which requests are unfinished."""

    def __init__(self, run_id: int):
        self.run_id = run_id
        self._encoder = SnapshotEncoder()
        self._seen_a_step = False
        self.unfinished: set[str] = set()   # added, no final output yet: the run is interrupted if it ends now
        self.empty = True                   # no request and no step so far

    def add(self, rows: Rows, record: RequestAdded | LoggedStep) -> None:
        self.empty = False
        if isinstance(record, RequestAdded):
            rows.added_requests.append({"run_id": self.run_id, **dataclasses.asdict(record)})
            self.unfinished.add(record.request_id)
            return
        for output in record.finished:
            self.unfinished.discard(output.request_id)
            rows.finished_requests.append(self._finished_row(output))
        stats = record.stats
        if not self._seen_a_step:
            # The config may leave the pool size to the engine; record what it chose.
            rows.run_update["num_blocks"] = stats.num_total_blocks
            self._seen_a_step = True
        row = {"run_id": self.run_id, "num_used_blocks": stats.num_total_blocks - stats.num_free_blocks}
        row.update((name, getattr(stats, name)) for name in _STATS_COLUMNS)
        # Every row has every key (the writer inserts a batch with the first row's columns): NULL for one group.
        row.update((name, json.dumps(list(getattr(stats, name))) if stats.group_held_blocks else None)
                   for name in GROUP_COLUMNS)
        rows.steps.append(row)
        step = stats.step
        rows.events.extend(
            {"run_id": self.run_id, "step": step, "kind": e.kind, "request_id": e.request_id,
             "blocks": json.dumps(list(e.blocks)), "detail": e.detail}
            for e in record.events
        )
        keyframe, blob = self._encoder.encode(record.snapshot)
        rows.snapshots.append({"run_id": self.run_id, "step": step, "keyframe": int(keyframe), "data": blob})

    def _finished_row(self, output: RequestOutput) -> dict:
        metrics = output.metrics
        return {
            "run_id": self.run_id, "request_id": output.request_id,
            "num_prompt_tokens": len(output.prompt_token_ids),
            "output_text": output.text, "num_output_tokens": _num_tokens(output),
            "sample_texts": json.dumps([s.text for s in output.samples]) if len(output.samples) > 1 else None,
            "arrival_time": metrics.arrival_time, "first_token_time": metrics.first_token_time,
            "finish_time": metrics.finished_time, "finish_reason": output.finish_reason,
            "num_cached_tokens": output.num_cached_tokens, "num_preemptions": output.num_preemptions,
            "error": output.error,
        }
