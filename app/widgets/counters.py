"""The pool's counters: free blocks, KV usage, token utilisation, prefix-cache hits, preemptions, swaps,
copy-on-write copies and evictions of cached blocks; with KV-cache groups, the blocks each attention kind holds
and those its sliding window let go of. The panel keeps its height then: preemptions and swaps share a line, and the
step number, which the event line under the map also gives, makes room."""

from __future__ import annotations

from collections.abc import Sequence

from kvscope.app.widgets.formatting import bar, percent
from kvscope.app.widgets.group_kinds import attention_kinds, kind_name, per_kind
from kvscope.app.widgets.line_panel import LinePanel
from kvscope.engine.outputs import KVCacheGroup, StepStats

BAR_WIDTH = 8
NBSP = "\u00a0"     # a figure and its word wrap as one: "(194 cached)", never "(194" / "cached)"


def describe_stats(stats: StepStats, width: int | None = None, groups: Sequence[KVCacheGroup] = ()) -> str:
    """Markup text of the counters; what the panel shows, and what the tests read. The cached count shares the
    free blocks' line where ``width`` holds both (always, when None), else has a line of its own: a wrap would
    put it under the label column."""
    hits = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    free = f"free blocks  {stats.num_free_blocks:,} / {stats.num_total_blocks:,}"
    cached = f"({stats.num_cached_free_blocks:,}{NBSP}cached)"
    if width is None or len(free) + 1 + len(cached) <= width:
        free_lines = [f"{free} [dim]{cached}[/]"]
    else:
        free_lines = [free, f"[dim]  of which   {stats.num_cached_free_blocks:,}{NBSP}cached[/]"]
    grouped = bool(groups and stats.group_held_blocks)
    lines = [
        *([] if grouped else [f"step         {stats.step:,}"]),
        *free_lines,
        f"KV usage    {percent(stats.kv_usage)} [$accent]{bar(stats.kv_usage, BAR_WIDTH)}[/]",
        f"token util. {percent(stats.kv_token_utilisation)} "
        f"[$success]{bar(stats.kv_token_utilisation, BAR_WIDTH)}[/]",
        f"prefix hits {percent(hits)} [dim]{stats.prefix_cache_hits:,}/{stats.prefix_cache_queries:,}{NBSP}tok[/]",
        *(_group_lines(stats, groups) if grouped else [
            f"preemptions  {stats.num_preemptions:,}",
            f"swap out/in  {stats.num_swapped_out_blocks:,} / {stats.num_swapped_in_blocks:,} blocks"]),
        # Short enough for the narrowest panel: copy-on-write copies, then cached blocks evicted.
        f"CoW/evicted  {stats.num_copy_on_write_blocks:,} / {stats.num_evicted_blocks:,} blocks",
    ]
    if stats.num_host_blocks:
        lines.append(f"host pool    {stats.num_host_blocks - stats.num_free_host_blocks:,} / "
                     f"{stats.num_host_blocks:,} blocks")
    return "\n".join(lines)


def _group_lines(stats: StepStats, groups: Sequence[KVCacheGroup]) -> list[str]:
    held = per_kind(groups, stats.group_held_blocks)
    kinds = attention_kinds(groups)
    freed, step = sum(stats.window_freed_blocks), sum(stats.window_freed_step)
    return [
        f"preempt/swap {stats.num_preemptions:,} · {stats.num_swapped_out_blocks:,}/{stats.num_swapped_in_blocks:,}"
        f"{NBSP}blocks",
        # Blocks, as every figure of the panel: "held  full 162 · sliding 512: 46", short enough for 120x40.
        "held  " + " · ".join(f"{kind_name(w, short=True).replace(' ', NBSP)}{':' if w else ''}{NBSP}{n:,}"
                              for w, n in zip(kinds, held, strict=True)),
        f"window freed {freed:,} [dim](+{step:,}{NBSP}this{NBSP}step)[/]",
    ]


class Counters(LinePanel):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__("waiting for the first step…", id=id, classes=classes)
        self.stats: StepStats | None = None
        self.groups: tuple[KVCacheGroup, ...] = ()

    def show_stats(self, stats: StepStats, groups: tuple[KVCacheGroup, ...] = ()) -> None:
        """``groups``: the snapshot's KV-cache groups, which name the per-group counters."""
        if stats != self.stats or groups != self.groups:
            self.stats, self.groups = stats, groups
            self.show(describe_stats(stats, self._width or None, groups))

    def on_resize(self) -> None:
        if self.stats is not None:
            self.show(describe_stats(self.stats, self._width or None, self.groups))
