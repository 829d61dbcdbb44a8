"""The server's counters: pool use, prefix-cache hits, preemptions, and TTFT / inter-token latency.

Rates are vLLM's log-line averages (see rates.py); latencies are estimated from
histogram buckets, so they are as coarse as the buckets, and the panel says
which observations they come from.
"""

from __future__ import annotations

from kvscope.app.attach.feed.frame import AttachFrame
from kvscope.app.attach.feed.rates import Quantiles
from kvscope.app.widgets.formatting import bar, percent
from kvscope.app.widgets.line_panel import LinePanel

BAR_WIDTH = 8


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def describe_latency(label: str, quantiles: Quantiles | None) -> str:
    if quantiles is None:
        return f"{label:<11} [dim]no observations yet[/]"
    p99 = (">" if quantiles.p99_open else "") + _seconds(quantiles.p99)
    where = "last 10 s" if quantiles.recent else "since start"
    return f"{label:<11} p50 {_seconds(quantiles.p50):>7} · p99 {p99:>7} [dim]({quantiles.count:,} obs., {where})[/]"


def describe_pools(frame: AttachFrame) -> list[str]:
    total = sum(pool.num_blocks for pool in frame.pools)
    in_use = [pool.num_in_use_blocks for pool in frame.pools]
    lines = []
    if None not in in_use and total:
        used = sum(in_use)
        lines.append(f"KV in use   {percent(used / total)} [$accent]{bar(used / total, BAR_WIDTH)}[/] "
                     f"{used:,}/{total:,} blocks")
    if frame.has_events:
        known = sum(pool.num_known_blocks for pool in frame.pools)
        free = sum(pool.num_cached_free_at_least for pool in frame.pools)
        band = sum(pool.num_unannounced_blocks for pool in frame.pools)
        lines.append(f"announced   {known:,} full blocks [dim](≥ {free:,} cached and free)[/]")
        lines.append(f"unannounced ≥ {band:,} in use [dim](partly filled, from usage)[/]")
    return lines


def describe_counters(frame: AttachFrame) -> str:
    rates = frame.rates
    if rates is None:
        return "waiting for the first /metrics sample…"
    lines = describe_pools(frame)
    if rates.hit_rate is None:
        lines.append("prefix hits [dim]no prefix-cache queries yet[/]")
    else:
        window = f" · last 10 s {percent(rates.window_hit_rate).strip()}" if rates.window_hit_rate is not None else ""
        totals = frame.metrics.totals()
        lines.append(f"prefix hits {percent(rates.hit_rate)} [dim]{int(totals.prefix_cache_hits):,}/"
                     f"{int(totals.prefix_cache_queries):,} tok{window}[/]")
    recent = f"{rates.window_preemptions:,} in the last {rates.window_s:.0f} s; " if rates.window_s else ""
    server = frame.server
    how = "swapped out, or recomputed when the host pool is full" if server.is_kvscope and server.swap_blocks \
        else "recomputed" if server.is_kvscope else "recomputed, never swapped"
    lines.append(f"preemptions {rates.num_preemptions:,} [dim]({recent}{how})[/]")
    lines.append(describe_latency("TTFT", rates.ttft))
    lines.append(describe_latency("inter-token", rates.itl))
    return "\n".join(lines)


class ServerCounters(LinePanel):
    PLACEHOLDER = "waiting for the server…"

    def show_frame(self, frame: AttachFrame) -> None:
        self.show(describe_counters(frame))
