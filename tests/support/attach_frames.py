"""AttachFrames made from recorded vLLM data, without sockets or threads: for the window's tests.

The events are the recorded payloads, decoded and applied as the data source
applies them; the metrics are recorded pages; the stream status is the one the
real subscriber reported for them, with fixed endpoints, so snapshots do not
depend on the ports a test happened to get.
"""

from __future__ import annotations

import dataclasses

from vllm_fakes import SHARED, recorded_payloads, timeseries_pages

from kvscope.app.attach.feed.events import BatchDecoder
from kvscope.app.attach.feed.metrics import parse_metrics
from kvscope.app.attach.feed.server import EVENTS_FLAG, EventEndpoint, ServerInfo
from kvscope.app.attach.feed.source import AttachSource
from kvscope.app.attach.feed.subscriber import Delivery, StreamStatus

URL = "http://127.0.0.1:8011"
ENDPOINT = EventEndpoint("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv-events", rank=0)


def recorded_server(events: bool = True, ranks: int = 1) -> ServerInfo:
    sources = tuple(dataclasses.replace(ENDPOINT, endpoint=f"tcp://127.0.0.1:{5557 + r}",
                                        replay=f"tcp://127.0.0.1:{6557 + r}", rank=r) for r in range(ranks))
    return ServerInfo(url=URL, version="0.32.0", model="smollm2", model_root=None, max_model_len=1024,
                      num_gpu_blocks=96, block_size=32, engines=tuple(str(r) for r in range(ranks)),
                      prefix_caching=True, event_sources=sources if events else (),
                      events_note="" if events else f"this server publishes no KV-cache events: start vLLM with "
                      f"{EVENTS_FLAG}")


def status(last_seq: int, events: int, **changes) -> StreamStatus:
    fields = dict(endpoint=ENDPOINT.endpoint, replay=ENDPOINT.replay, last_seq=last_seq, first_seq=0,
                  num_batches=last_seq + 1, num_events=events, num_malformed=0, unknown_kinds=(), num_gaps=0,
                  num_replayed=0, num_lost=0, num_restarts=0, last_event_time=None)
    return StreamStatus(**{**fields, **changes})


class RecordedSource(AttachSource):
    """The data source with recorded deliveries instead of sockets."""

    def __init__(self, server: ServerInfo, **kwargs) -> None:
        super().__init__(server, publish=lambda frame: None, **kwargs)
        self.stream_statuses: tuple[StreamStatus, ...] = ()

    def deliver(self, payloads: list[bytes], first_seq: int = 0, stream_index: int = 0) -> None:
        decoder = BatchDecoder()
        self.apply(stream_index, [Delivery(first_seq + i, decoder.decode(p)) for i, p in enumerate(payloads)])

    def make_frame(self, pools=None):
        frame = super().make_frame(pools)
        return dataclasses.replace(frame, streams=self.stream_statuses, time=0.0)


def busy_source(preview_text=None, preview_note: str = "") -> RecordedSource:
    """The recorded run: every event applied, the time series sampled up to its busiest moment."""
    source = RecordedSource(recorded_server(), preview_text=preview_text, preview_note=preview_note)
    payloads = recorded_payloads()
    pages = timeseries_pages()
    for t, page in pages[:12]:
        source.take_sample(parse_metrics(page, t))
    source.deliver(payloads[:9])
    for t, page in pages[12:]:
        source.take_sample(parse_metrics(page, t))
    source.deliver(payloads[9:], first_seq=9)
    events = sum(len(BatchDecoder().decode(p).events) for p in payloads)
    source.stream_statuses = (status(len(payloads) - 1, events, num_replayed=20),)
    source.take_sample(parse_metrics((SHARED / "metrics.txt").read_text(), pages[-1][0] + 1))
    return source
