"""AttachFrame: everything the attached window shows at one moment, immutable.

The data source thread makes one whenever a metrics sample comes in and, in
between, whenever events changed a pool (at most a few times a second). It is
posted to the UI thread as it is; the UI keeps the newest and never mutates it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from kvscope.app.attach.feed.metrics import MetricsSample
from kvscope.app.attach.feed.pool_view import PoolView
from kvscope.app.attach.feed.rates import ServerRates
from kvscope.app.attach.feed.server import ServerInfo
from kvscope.app.attach.feed.subscriber import StreamStatus
from kvscope.engine.outputs import StepStats

CONNECTING, CONNECTED, DISCONNECTED = "connecting", "connected", "disconnected"


@dataclass(frozen=True)
class Connection:
    state: str                      # CONNECTING | CONNECTED | DISCONNECTED
    detail: str = ""                # why it is disconnected
    retry_in_s: float | None = None  # the backoff before the next try

    @property
    def label(self) -> str:
        return "disconnected, retrying" if self.state == DISCONNECTED else self.state


class QueuePoint(NamedTuple):
    """Running and waiting at one metrics sample (the queue panel's history)."""

    time: float
    num_running: int
    num_waiting: int
    waiting_by_reason: tuple[tuple[str, int], ...]


class Notice(NamedTuple):
    time: float
    text: str


@dataclass(frozen=True)
class BadSamples:
    """/metrics pages that answered but could not be believed (numbers out of range, series gone)."""

    count: int = 0                  # since kvscope attached
    in_a_row: int = 0               # since the last good sample
    last_reason: str = ""

    def add(self, reason: str) -> BadSamples:
        return BadSamples(self.count + 1, self.in_a_row + 1, reason)

    def good(self) -> BadSamples:
        return self if self.in_a_row == 0 else dataclasses.replace(self, in_a_row=0)


@dataclass(frozen=True)
class AttachFrame:
    index: int                          # frames made so far
    time: float
    server: ServerInfo
    connection: Connection
    sample_index: int                   # metrics samples taken (a run log step each)
    metrics: MetricsSample | None       # the latest sample
    rates: ServerRates | None
    queue_history: tuple[QueuePoint, ...]
    pools: tuple[PoolView, ...]
    streams: tuple[StreamStatus, ...]
    notices: tuple[Notice, ...]         # the latest few, newest last
    preview_note: str = ""              # where prefix text comes from, or why it is token ids
    stats: StepStats | None = None      # the latest sample as a run log step (what the throughput plots)
    bad_samples: BadSamples = BadSamples()

    @property
    def has_events(self) -> bool:
        return bool(self.streams)
