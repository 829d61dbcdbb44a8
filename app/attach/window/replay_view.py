"""Replaying an attached session from the run log: the pools as the events drew them, step by step.

A step of a "vllm" run is a metrics sample. The replay screen's controls are
the app's; the panels are the attached window's map and slot inspector, and a
text panel with what the server said at that sample, and in words what it does
not publish (the local engine's counters would show those as zeros).
"""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult

from kvscope.app.attach.window.widgets.legend import AttachLegend
from kvscope.app.attach.window.widgets.pool_map import PoolMap, SlotHighlighted
from kvscope.app.attach.window.widgets.slot_inspector import SlotInspector
from kvscope.app.messages import RequestSelected
from kvscope.app.runlog import RunLogReader
from kvscope.app.screens.replay import ReplayScreen
from kvscope.app.widgets.box import Box
from kvscope.app.widgets.formatting import percent
from kvscope.app.widgets.line_panel import LinePanel
from kvscope.engine.outputs import CacheSnapshot, EngineEvent, StepStats


def describe_sample(snapshot: CacheSnapshot, stats: StepStats) -> str:
    announced = int((snapshot.block_fill == snapshot.block_size).sum())
    hits = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else None
    in_use = stats.num_total_blocks - stats.num_free_blocks
    return "\n".join([
        f"sample {stats.step:,} · running {stats.num_running} · waiting {stats.num_waiting}",
        f"KV in use   {percent(stats.kv_usage)} [dim]{in_use:,}/{stats.num_total_blocks:,} blocks[/]",
        f"announced   {announced:,} full blocks [dim](≥ {stats.num_cached_free_blocks:,} cached and free)[/]",
        "prefix hits " + (f"{percent(hits)} [dim]{stats.prefix_cache_hits:,}/{stats.prefix_cache_queries:,} "
                          "tok since the server started[/]" if hits is not None else "[dim]no queries yet[/]"),
        f"preemptions {stats.num_preemptions:,} [dim](recomputed: vLLM V1 never swaps)[/]",
        f"throughput  {stats.prompt_tokens_per_s:,.0f} prompt · {stats.generation_tokens_per_s:,.0f} generated "
        "tok/s [dim](10 s averages)[/]",
        f"this sample {stats.num_prefill_tokens:,} prompt · {stats.num_decode_tokens:,} generated tokens "
        f"[dim]in {stats.duration:.1f} s[/]",
        "[dim]vLLM does not publish per-request rows, token utilisation or step times.[/]",
    ])


class SamplePanel(LinePanel):
    def show_sample(self, snapshot: CacheSnapshot, stats: StepStats) -> None:
        self.show(describe_sample(snapshot, stats))


class VllmReplayView(Box):
    """A StepView (app/screens/replay.py), as SnapshotView is: what ReplayScreen draws a step with, for a run
    kvscope watched instead of ran."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.pool_map = PoolMap(0, id="pool-map-0", classes="panel pool-map")
        self.pool_map.border_title = "Block map · the pools as the events drew them"
        self.inspector = SlotInspector(id="inspector", classes="panel")
        self.inspector.border_title = "Slot"
        self.sample = SamplePanel(id="sample", classes="panel")
        self.sample.border_title = "Server at this sample"

    def compose(self) -> ComposeResult:
        with Box(id="map-column"):
            yield self.pool_map
            yield AttachLegend(id="legend")
            yield self.inspector
        yield self.sample

    @property
    def block_map(self) -> PoolMap:
        """StepView's map: the replay hands the keys back to it after a jump."""
        return self.pool_map

    def show(self, snapshot: CacheSnapshot, stats: StepStats, events: tuple[EngineEvent, ...] = (),
             previous: CacheSnapshot | None = None) -> None:
        # StepView's signature; the events and the step before feed SnapshotView's event line, which a watched
        # server's replay has no use for: vLLM's pools already say what its KV events did.
        self.pool_map.show_snapshot(snapshot)
        self.inspector.show_snapshot(snapshot)
        self.sample.show_sample(snapshot, stats)

    def on_slot_highlighted(self, message: SlotHighlighted) -> None:
        message.stop()
        self.inspector.inspect(message.slot)

    def on_request_selected(self, message: RequestSelected) -> None:
        message.stop()
        self.pool_map.select_request(message.request_id)


def replay_screen_for(reader: RunLogReader, run_id: int) -> ReplayScreen:
    """History's ``replay_for`` in both windows: a watched vLLM server's run replays with the attached
    window's panels, every other run with the app's."""
    if reader.run(run_id).get("source") == "vllm":
        return VllmReplayScreen(reader, run_id)
    return ReplayScreen(reader, run_id)


class VllmReplayScreen(ReplayScreen):
    """The app's replay (its controls, its frames from the log), drawing each step with VllmReplayView."""

    # Its own styles: History opens it from the app's window as well as from the attached one.
    CSS_PATH = Path(__file__).with_name("attach.tcss")

    def __init__(self, reader: RunLogReader, run_id: int) -> None:
        super().__init__(reader, run_id)
        self.view = VllmReplayView(id="vllm-replay-body")
