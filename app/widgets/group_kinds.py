"""KV-cache groups as the window names them: by attention kind, not by index.

Gemma 3 has six groups, one of full attention and five of the same 512-token window; what a class needs to tell
apart is the two kinds ("full attention", "sliding window 512"), so the map's group selector, its legend and the
counters gather the groups of one kind together. The inspector and the block table still name the group itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvscope.engine.outputs import KVCacheGroup  # the snapshot's record of a group


def attention_kinds(groups: Sequence[KVCacheGroup]) -> tuple[int | None, ...]:
    """Each kind's window (None: full attention) once, in the groups' order (full attention first)."""
    return tuple(dict.fromkeys(group.sliding_window for group in groups))


def kind_of_group(groups: Sequence[KVCacheGroup]) -> tuple[int, ...]:
    """Per group, the index of its kind in attention_kinds."""
    kinds = attention_kinds(groups)
    return tuple(kinds.index(group.sliding_window) for group in groups)


def kind_name(window: int | None, *, short: bool = False) -> str:
    if window is None:
        return "full" if short else "full attention"
    return f"sliding {window}" if short else f"sliding window {window}"


def per_kind(groups: Sequence[KVCacheGroup], counts: Sequence[int]) -> list[int]:
    """Per-group counts summed per kind."""
    totals = [0] * len(attention_kinds(groups))
    for kind, count in zip(kind_of_group(groups), counts, strict=True):
        totals[kind] += count
    return totals
