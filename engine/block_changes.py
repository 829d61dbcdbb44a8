"""The block pool's per-block arrays as a chain of changes, built whole only when a consumer asks.

A step changes a few blocks of a pool that may hold hundreds of thousands, so copying the four arrays every
step made its cost grow with the pool. Instead each published version records the blocks the pool changed
(indices and their new values) on top of the previous version; the whole arrays of a version are built on
first access (a window frame, a run-log keyframe) from the nearest version that has them. Every
KEYFRAME_VERSIONS versions one carries whole arrays, which bounds both that walk and what a chain keeps alive.
"""

from __future__ import annotations

import itertools
import threading
from typing import NamedTuple

import numpy as np

ARRAY_NAMES = ("block_state", "ref_counts", "block_fill", "block_hashes")
KEYFRAME_VERSIONS = 256
_publishers = itertools.count()
_building = threading.Lock()    # snapshots are read from other threads (the window, the run-log writer)


class BlockChanges(NamedTuple):
    """What one version changed: sorted block indices and, per array of ARRAY_NAMES, their new values."""

    indices: np.ndarray
    values: tuple[np.ndarray, ...]


class BlockArrays:
    """The four per-block arrays at one version: held whole, or as ``changes`` on ``previous``."""

    __slots__ = ("changes", "version", "_previous", "_arrays")

    def __init__(self, changes: BlockChanges | None, previous: BlockArrays | None = None,
                 arrays: tuple[np.ndarray, ...] | None = None, version: tuple[int, int] | None = None) -> None:
        if arrays is None and (previous is None or changes is None):
            raise ValueError("a version without whole arrays needs its changes and the version before it")
        self.changes = changes          # None: unknown (a keyframe made after a change to every block)
        # (publisher, number): ``changes`` lead here from the version numbered one less of the same publisher.
        self.version = version
        self._previous = None if arrays is not None else previous
        self._arrays = None if arrays is None else tuple(arrays)   # as given: a hand-made snapshot's stay its own

    @property
    def held_bytes(self) -> int:
        """What this version keeps alive by itself: its whole arrays once built, else its changes."""
        if self._arrays is not None:
            return sum(a.nbytes for a in self._arrays)
        return self.changes.indices.nbytes + sum(v.nbytes for v in self.changes.values)

    @classmethod
    def whole(cls, arrays) -> BlockArrays:
        return cls(None, arrays=tuple(arrays))

    def arrays(self) -> tuple[np.ndarray, ...]:
        """Read-only (block_state, ref_counts, block_fill, block_hashes), built on the first call."""
        built = self._arrays
        if built is not None:
            return built
        with _building:
            if self._arrays is None:
                chain, node = [], self
                while node._arrays is None:
                    chain.append(node.changes)
                    node = node._previous
                arrays = [a.copy() for a in node._arrays]
                for changes in reversed(chain):
                    for array, values in zip(arrays, changes.values, strict=True):
                        array[changes.indices] = values
                self._arrays = tuple(_frozen(a) for a in arrays)
                self._previous = None   # the versions before no longer need to stay alive for this one
            return self._arrays


def _frozen(array: np.ndarray) -> np.ndarray:
    """``array``, which nothing else holds, made read-only."""
    array.flags.writeable = False
    return array


class BlockPublisher:
    """Publishes a pool's arrays once per call, as changes since the last call (see the module's doc)."""

    def __init__(self) -> None:
        self.origin = next(_publishers)
        self.number = 0
        self.latest: BlockArrays | None = None
        self._since_keyframe = 0
        self._fill: np.ndarray | None = None    # the last published fill, so the total stays O(changes)
        self.fill_total = 0

    def publish(self, pool, advance: bool = True) -> tuple[BlockArrays, int]:
        """A new version and the pool's total fill. ``advance=False`` peeks between steps: the version is
        not kept as the base and its changes stay queued, so the next step's version still reports them."""
        changed = pool.take_changes() if advance else pool.peek_changes()
        live = (pool.state, pool.ref_counts, pool.fill, pool.hashes)
        stamp = None    # a look between steps is no link of the chain: nothing follows from it
        if advance:
            self.number += 1
            stamp = (self.origin, self.number)
        if changed is None or self.latest is None or (advance and self._since_keyframe >= KEYFRAME_VERSIONS - 1):
            arrays = tuple(_frozen(a.copy()) for a in live)
            changes = None if changed is None or self.latest is None else _changes(live, changed)
            version = BlockArrays(changes, arrays=arrays, version=stamp)
            fill_total = int(pool.fill.sum(dtype=np.int64))
            if advance:
                self.latest, self._since_keyframe = version, 0
                self._fill, self.fill_total = pool.fill.copy(), fill_total
            return version, fill_total
        changes = _changes(live, changed)
        fill = changes.values[2]
        fill_total = (self.fill_total + int(fill.sum(dtype=np.int64))
                      - int(self._fill[changes.indices].sum(dtype=np.int64)))
        version = BlockArrays(changes, self.latest, version=stamp)
        if advance:
            self._fill[changes.indices] = fill
            self.latest, self.fill_total = version, fill_total
            self._since_keyframe += 1
        return version, fill_total


def _changes(live, changed: np.ndarray) -> BlockChanges:
    return BlockChanges(changed, tuple(_frozen(a[changed]) for a in live))
