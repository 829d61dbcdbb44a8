"""The KV-cache groups a vLLM server's events name, and the blocks each has announced.

vLLM's hybrid KV cache manager keeps one prefix cache per group, keyed by (block hash, group): a model with full
and sliding-window layers announces the same prefix once per group. Since vLLM 0.32 its events say which:
BlockStored carries ``group_idx`` with the group's kind and window (``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``), BlockRemoved the ``group_idx``. Where they do, the pool keeps each group's
blocks apart and the window counts them per group; where no event names a group (older releases, or the
tagged-array encoding, which carries no such fields), the window says so in one line.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

NO_GROUP_NOTE = "vLLM's KV events do not say which KV-cache group a block belongs to"


class GroupSeen(NamedTuple):
    """One group as the events describe it."""

    index: int
    kind: str | None            # vLLM's KVCacheSpecKind value: "full_attention", "sliding_window", …
    sliding_window: int | None
    num_blocks: int             # announced and not evicted

    @property
    def name(self) -> str:
        if self.kind == "sliding_window" and self.sliding_window:
            return f"sliding window {self.sliding_window:,}"
        return (self.kind or "kind not given").replace("_", " ")


def group_of(event) -> int | None:
    """The group an event names (None: it names none). Tagged-array events have no such field."""
    group = getattr(event, "group_idx", None)
    return group if isinstance(group, int) and group >= 0 else None


def block_key(block_hash, group: int | None):
    """A block's key in the pool: its hash for group 0 (and for events naming no group), so a one-group
    server's pool is keyed as it always was; (group, hash) for the others."""
    return (group, block_hash) if group else block_hash


class GroupTally:
    """Per slot, the group of the block it holds; per group, its spec and how many blocks it holds."""

    def __init__(self, num_slots: int) -> None:
        self.group_at = array("i", [-1]) * num_slots
        self.specs: dict[int, tuple[str | None, int | None]] = {}
        self.counts: dict[int, int] = {}
        self.named = False          # some event named a group

    def learn(self, event, group: int) -> None:
        """A store event's spec for its group (a removal names only the group)."""
        self.named = True
        kind = getattr(event, "kv_cache_spec_kind", None)
        if kind is not None or group not in self.specs:
            window = getattr(event, "kv_cache_spec_sliding_window", None)
            self.specs[group] = (kind if isinstance(kind, str) else None, window if isinstance(window, int) else None)

    def stored(self, slot: int, group: int | None) -> None:
        if group is None:
            return
        self.group_at[slot] = group
        self.counts[group] = self.counts.get(group, 0) + 1

    def released(self, slot: int) -> None:
        group = self.group_at[slot]
        if group >= 0:
            self.group_at[slot] = -1
            self.counts[group] -= 1

    def cleared(self, used: int) -> None:
        self.group_at[:used] = array("i", [-1]) * used
        self.counts = dict.fromkeys(self.counts, 0)

    def groups(self) -> tuple[GroupSeen, ...]:
        return tuple(GroupSeen(group, *self.specs.get(group, (None, None)), self.counts.get(group, 0))
                     for group in sorted(set(self.specs) | set(self.counts)))
