"""Turns what the logger is handed (request arrivals, StepResults) into table rows.

Runs on the writer thread, so the engine thread never waits for it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from kvscope.app.runlog.schema import GROUP_COLUMNS, STEP_COLUMNS
from kvscope.app.runlog.snapshots import SnapshotEncoder
from kvscope.engine.outputs import RequestOutput, StepResult, StepStats

# The steps table's columns that are StepStats fields, copied as they are; the rest (run_id, the generated tokens
# counted here, the used blocks) the builder fills itself.
_STATS_COLUMNS = tuple(name for name in STEP_COLUMNS if name in {f.name for f in dataclasses.fields(StepStats)}
                       and name not in GROUP_COLUMNS)


@dataclass(frozen=True)
class RequestAdded:
    request_id: str
    prompt_text: str
    num_prompt_tokens: int
    n: int


@dataclass(frozen=True)
class ObservedStep:
    """A step of a run kvscope only watches (a vLLM server): its outputs are not published, so the
    tokens generated in the step are counted by the server and given here."""

    result: StepResult
    num_generated_tokens: int


def record_bytes(record: RequestAdded | StepResult | ObservedStep) -> int:
    """About what a queued record keeps alive: its snapshot's block changes (or whole arrays, where it holds
    them) and a few hundred bytes per request, output and event. An estimate: it bounds the writer's queue."""
    if isinstance(record, RequestAdded):
        return 256 + len(record.prompt_text)
    result = record.result if isinstance(record, ObservedStep) else record
    snapshot = result.snapshot
    return (1024 + snapshot.blocks.held_bytes
            + 256 * (snapshot.num_requests + len(result.outputs) + len(result.events) + len(result.kv_events)))


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
    """Stateful per run: it diffs snapshots and counts tokens across steps."""

    def __init__(self, run_id: int):
        self.run_id = run_id
        self._encoder = SnapshotEncoder()
        # Tokens each unfinished request had produced (all samples) when last seen, so a
        # step's generated-token count is exact whatever the engine's rate definition.
        self._tokens_seen: dict[str, int] = {}
        self._seen_a_step = False
        self.unfinished: set[str] = set()   # added, no final output yet: the run is interrupted if it ends now
        self.empty = True                   # no request and no step so far

    def add(self, rows: Rows, record: RequestAdded | StepResult | ObservedStep) -> None:
        self.empty = False
        if isinstance(record, RequestAdded):
            rows.added_requests.append({"run_id": self.run_id, **dataclasses.asdict(record)})
            self.unfinished.add(record.request_id)
        elif isinstance(record, ObservedStep):
            self._add_step(rows, record.result, record.num_generated_tokens)
        else:
            self._add_step(rows, record)

    def _add_step(self, rows: Rows, result: StepResult, observed_tokens: int = 0) -> None:
        step = result.stats.step
        generated = observed_tokens
        seen = self._tokens_seen
        for output in result.outputs:     # every request every step: no call per output but the count's
            request_id = output.request_id
            total = _num_tokens(output)
            new = total - seen.get(request_id, 0)
            if new > 0:
                generated += new
            if output.finished:
                seen.pop(request_id, None)
                self.unfinished.discard(request_id)
                rows.finished_requests.append(self._finished_row(output, total))
            else:
                seen[request_id] = total
        stats = result.stats
        if not self._seen_a_step:
            # The config may leave the pool size to the engine; record what it chose.
            rows.run_update["num_blocks"] = stats.num_total_blocks
            self._seen_a_step = True
        row = {"run_id": self.run_id, "num_generated_tokens": generated,
               "num_used_blocks": stats.num_total_blocks - stats.num_free_blocks}
        row.update((name, getattr(stats, name)) for name in _STATS_COLUMNS)
        # Every row has every key (the writer inserts a batch with the first row's columns): NULL for one group.
        row.update((name, json.dumps(list(getattr(stats, name))) if stats.group_held_blocks else None)
                   for name in GROUP_COLUMNS)
        rows.steps.append(row)
        rows.events.extend(
            {"run_id": self.run_id, "step": step, "kind": e.kind, "request_id": e.request_id,
             "blocks": json.dumps(list(e.blocks)), "detail": e.detail}
            for e in result.events
        )
        keyframe, blob = self._encoder.encode(result.snapshot)
        rows.snapshots.append({"run_id": self.run_id, "step": step, "keyframe": int(keyframe), "data": blob})

    def _finished_row(self, output: RequestOutput, num_tokens: int) -> dict:
        metrics = output.metrics
        return {
            "run_id": self.run_id, "request_id": output.request_id,
            "num_prompt_tokens": len(output.prompt_token_ids),
            "output_text": output.text, "num_output_tokens": num_tokens,
            "sample_texts": json.dumps([s.text for s in output.samples]) if len(output.samples) > 1 else None,
            "arrival_time": metrics.arrival_time, "first_token_time": metrics.first_token_time,
            "finish_time": metrics.finished_time, "finish_reason": output.finish_reason,
            "num_cached_tokens": output.num_cached_tokens, "num_preemptions": output.num_preemptions,
            "error": output.error,
        }
