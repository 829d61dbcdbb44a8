"""Small text helpers shared by the panels: horizontal bars and compact numbers."""

from __future__ import annotations

_EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(fraction: float, width: int) -> str:
    """A left-aligned bar of ``width`` cells, filled to ``fraction`` in eighths of a cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, partial = divmod(eighths, 8)
    text = "█" * full + (_EIGHTHS[partial] if partial else "")
    return text.ljust(width)


def percent(fraction: float) -> str:
    return f"{100 * fraction:5.1f}%"


def compact(value: float) -> str:
    """1234 -> '1.2k', 12.5 -> '12.5', 0.25 -> '0.25'."""
    if value >= 10_000:
        return f"{value / 1000:,.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    if value >= 10:
        return f"{value:.0f}"
    return f"{value:.2g}" if value else "0"


def mebibytes(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 1024:,.0f} KiB"
