"""The attached window: the app's block map per rank and the vLLM server's own panels, fed by AttachFrames.

Frames arrive from the data source thread as messages; the newest is drawn at
most FRAME_RATE times a second (the maps), and the panels of numbers at most
TEXT_RATE times, as in the live window.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.screen import Screen

from kvscope.app.actions import FOOTER_RANKS
from kvscope.app.attach.feed.frame import AttachFrame
from kvscope.app.attach.window.widgets.events_panel import EventsPanel
from kvscope.app.attach.window.widgets.header import AttachHeader
from kvscope.app.attach.window.widgets.legend import AttachLegend
from kvscope.app.attach.window.widgets.pool_map import PoolMap, SlotHighlighted
from kvscope.app.attach.window.widgets.prefix_trees import PrefixTrees
from kvscope.app.attach.window.widgets.server_counters import ServerCounters
from kvscope.app.attach.window.widgets.server_queues import ServerQueues
from kvscope.app.attach.window.widgets.slot_inspector import SlotInspector
from kvscope.app.messages import RequestSelected
from kvscope.app.safe_text import escape, one_line
from kvscope.app.widgets.box import Box, titled
from kvscope.app.widgets.key_bar import KeyBar
from kvscope.app.widgets.throughput import Series, Throughput

FRAME_RATE = 10
TEXT_RATE = 4
SERVER_SERIES = (
    Series("prompt_tokens_per_s", "prompt", "tok/s"),
    Series("generation_tokens_per_s", "generate", "tok/s"),
    Series("kv", "KV use", "%", ceiling=100.0),
)


def map_title(frame: AttachFrame, index: int) -> str:
    pool = frame.pools[index]
    # A label may name an endpoint the server listed: border titles are markup.
    return f"Block map · {escape(one_line(pool.label, 100))} · {pool.num_known_blocks:,} announced of " \
           f"{pool.num_blocks:,}"


class AttachScreen(Screen):
    BLANK = True

    def __init__(self, url: str, num_pools: int) -> None:
        super().__init__(id="attach")
        self.latest: AttachFrame | None = None
        self._painted: AttachFrame | None = None
        self._texted: AttachFrame | None = None
        self._texted_at = 0.0
        self._sampled = 0    # the sample index the throughput was last pushed
        # Made here, not looked up: frames can arrive before the screen has mounted its panels.
        self.header = AttachHeader(url, id="header")
        self.maps = [titled(PoolMap(index, id=f"pool-map-{index}", classes="panel pool-map"), "Block map")
                     for index in range(max(num_pools, 1))]
        self.inspector = titled(SlotInspector(id="inspector", classes="panel"), "Slot")
        self.prefixes = titled(PrefixTrees(id="prefixes", classes="panel"), "Prefix trees")
        self.counters = titled(ServerCounters(id="counters", classes="panel"), "Server")
        self.throughput = titled(Throughput(series=SERVER_SERIES, id="throughput", classes="panel"),
                                 "Throughput · averaged over 10 s as vLLM's log line")
        self.queues = titled(ServerQueues(id="queues", classes="panel"), "Queues")
        self.events = titled(EventsPanel(id="events", classes="panel"), "KV-cache events")
        self._inspected: PoolMap = self.maps[0]

    def compose(self) -> ComposeResult:
        yield self.header
        with Box(id="body"):
            with Box(id="top", classes="row"):
                with Box(id="map-column"):
                    yield from self.maps
                    yield AttachLegend(id="legend")
                    yield self.inspector
                yield self.prefixes
            with Box(id="stats", classes="row"):
                yield self.counters
                yield self.throughput
            with Box(id="bottom", classes="row"):
                yield self.queues
                yield self.events
        yield KeyBar(keep_first=FOOTER_RANKS, id="keys")

    def on_mount(self) -> None:
        self.set_interval(1 / FRAME_RATE, self.paint)

    def show_frame(self, frame: AttachFrame) -> None:
        """Keep the newest frame; the throughput history takes every sample."""
        if frame.stats is not None and frame.sample_index != self._sampled:
            self._sampled = frame.sample_index
            self.throughput.push(frame.stats)
        self.latest = frame

    def paint(self, force: bool = False) -> None:
        frame = self.latest
        if frame is None or (frame is self._painted and frame is self._texted):
            return
        if frame is not self._painted:
            self._painted = frame
            self._add_maps(len(frame.pools))
            self.header.show_frame(frame)
            for index, pool_map in enumerate(self.maps[:len(frame.pools)]):
                pool_map.border_title = map_title(frame, index)
                pool_map.show_snapshot(frame.pools[index].snapshot)
            if self._inspected.pool_index < len(frame.pools):
                self.inspector.show_snapshot(frame.pools[self._inspected.pool_index].snapshot)
        now = time.monotonic()
        if frame is not self._texted and (force or now - self._texted_at >= 1 / TEXT_RATE):
            self._texted, self._texted_at = frame, now
            self.prefixes.show_frame(frame)
            self.counters.show_frame(frame)
            self.throughput.redraw()
            self.queues.show_frame(frame)
            self.events.show_frame(frame)

    def _add_maps(self, num_pools: int) -> None:
        """A publisher given by hand names its rank only in its batches: its pool may come after the start."""
        while len(self.maps) < num_pools:
            pool_map = titled(PoolMap(len(self.maps), id=f"pool-map-{len(self.maps)}", classes="panel pool-map"),
                              "Block map")
            self.maps.append(pool_map)
            self.query_one("#map-column").mount(pool_map, before=self.query_one(AttachLegend))

    def on_slot_highlighted(self, message: SlotHighlighted) -> None:
        message.stop()
        self._inspected = message.pool_map
        if self.latest is not None and message.pool_map.pool_index < len(self.latest.pools):
            self.inspector.show_snapshot(self.latest.pools[message.pool_map.pool_index].snapshot)
        self.inspector.inspect(message.slot)

    def on_request_selected(self, message: RequestSelected) -> None:
        message.stop()
        for pool_map in self.maps:
            pool_map.select_request(message.request_id)
