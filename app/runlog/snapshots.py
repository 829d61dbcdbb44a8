"""Block-map snapshots for replay, stored as keyframes plus deltas.

Every frame is one blob: zlib( u32 header length | JSON header | raw arrays ).
The header names each array's dtype and shape, so a blob reads back on any machine.

A keyframe holds the four per-block arrays whole; a delta holds, per array, the
indices that changed and their new values. Requests are diffed against the
previous frame: the integer counters of changed requests as one int32 matrix of
differences (a decode step is mostly +1s, which compress to almost nothing),
block tables as appended tails when they only grew, anything else by value.
Deltas are relative to the previously *encoded* frame, not the previous step, so
a frame the writer had to drop does not break the chain.
"""

from __future__ import annotations

import json
import math
import struct
import typing
import zlib

import numpy as np

from kvscope.engine.kv_cache_groups import KVCacheGroup
from kvscope.engine.outputs import CacheSnapshot, RequestView

# A keyframe costs the writer what the pool holds (5 MB of arrays at 330,000 blocks: 0.1 s to encode) and a delta
# what the step changed (a few KB): a keyframe every 50 frames cost 2 ms a step at that pool, more than the step
# itself. So a keyframe comes once the deltas since the last add up to as many raw bytes as it had, at least
# KEYFRAME_INTERVAL frames after it and at most MAX_KEYFRAME_INTERVAL: that bounds what a replay decodes to reach
# any step (reader.Replay).
KEYFRAME_INTERVAL = 50
MAX_KEYFRAME_INTERVAL = 500
BLOCK_ARRAYS = ("block_state", "ref_counts", "block_fill", "block_hashes")
_VIEW_TYPES = typing.get_type_hints(RequestView)
COUNTER_FIELDS = tuple(name for name in RequestView._fields if _VIEW_TYPES[name] is int)
TABLE_FIELDS = ("block_tables", "host_block_tables")
# Everything else but the id (queue, prompt preview, fields added later) is stored by value.
VALUE_FIELDS = tuple(name for name in RequestView._fields
                     if name not in COUNTER_FIELDS + TABLE_FIELDS + ("request_id",))
_HEAD = struct.Struct("<I")


# zlib's level for a keyframe (megabytes of whole arrays, now and then: its size counts) and for a delta (a few
# kilobytes every step: its time counts, and level 3 takes half of level 6's for 7% more bytes).
KEYFRAME_LEVEL, DELTA_LEVEL = 6, 3


def pack(header: dict, arrays: dict[str, np.ndarray], level: int = KEYFRAME_LEVEL) -> tuple[bytes, int]:
    """(the blob, its bytes before compression)."""
    header = {**header, "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]}
    head = json.dumps(header, separators=(",", ":")).encode()
    raw = _HEAD.pack(len(head)) + head + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
    return zlib.compress(raw, level), len(raw)


def unpack(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    raw = zlib.decompress(blob)
    (head_len,) = _HEAD.unpack_from(raw)
    offset = _HEAD.size + head_len
    header = json.loads(raw[_HEAD.size:offset])
    arrays = {}
    for name, dtype, shape in header.pop("arrays"):
        count = math.prod(shape)
        array = np.frombuffer(raw, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)
        arrays[name] = array
        offset += array.nbytes
    return header, arrays


def _grew(old: tuple[tuple[int, ...], ...], new: tuple[tuple[int, ...], ...]) -> bool:
    return len(old) == len(new) and all(n[:len(o)] == o for o, n in zip(old, new, strict=True))


_OTHER_FIELDS = TABLE_FIELDS + VALUE_FIELDS


def _other_changes(old: tuple | None, new: tuple) -> dict:
    """Table and value fields that differ from ``old`` (all of them for a new request)."""
    changes: dict = {}
    for index, name in enumerate(_OTHER_FIELDS):
        after = new[index]
        before = old[index] if old else None
        if old is not None and after == before:
            continue
        if name in TABLE_FIELDS and before and _grew(before, after):
            changes["+" + name] = [t[len(b):] for b, t in zip(before, after, strict=True)]
        else:
            changes[name] = after
    return changes


class SnapshotEncoder:
    """Turns the stream of one run's CacheSnapshots into (is_keyframe, blob) frames."""

    def __init__(self, keyframe_interval: int = KEYFRAME_INTERVAL,
                 max_keyframe_interval: int = MAX_KEYFRAME_INTERVAL):
        self._keyframe_interval = keyframe_interval
        self._max_keyframe_interval = max(keyframe_interval, max_keyframe_interval)
        self._frames_since_keyframe = 0
        self._keyframe_bytes = 0            # the last keyframe's, before compression
        self._bytes_since_keyframe = 0      # the deltas' since, the same way
        self._previous: CacheSnapshot | None = None
        # The previous frame's requests: their ids in order, their counter fields (a matrix, a row each) and
        # their other fields (a tuple each). No order: the next frame counts every request as new.
        self._previous_order: list[str] | None = None
        self._previous_counters: np.ndarray | None = None
        self._previous_others: list[tuple] = []

    def _needs_keyframe(self, snapshot: CacheSnapshot) -> bool:
        previous, frames = self._previous, self._frames_since_keyframe
        return (previous is None or frames >= self._max_keyframe_interval
                or (frames >= self._keyframe_interval and self._bytes_since_keyframe >= self._keyframe_bytes)
                or (previous.num_blocks, previous.block_size, previous.allocator)
                != (snapshot.num_blocks, snapshot.block_size, snapshot.allocator))

    def encode(self, snapshot: CacheSnapshot) -> tuple[bool, bytes]:
        keyframe = self._needs_keyframe(snapshot)
        header: dict = {"step": snapshot.step,
                        "host": [snapshot.num_host_blocks, snapshot.num_free_host_blocks]}
        if keyframe:
            header.update(block_size=snapshot.block_size, num_blocks=snapshot.num_blocks,
                          allocator=snapshot.allocator)
            if snapshot.kv_cache_groups:    # absent from one-group runs and from logs written before groups
                header["groups"] = [[list(g.layers), g.sliding_window] for g in snapshot.kv_cache_groups]
            arrays = {name: getattr(snapshot, name) for name in BLOCK_ARRAYS}
            self._previous_order = None
            self._frames_since_keyframe = 0
        else:
            arrays = self._block_deltas(snapshot)
        self._frames_since_keyframe += 1
        arrays.update(self._encode_requests(snapshot, header))
        self._previous = snapshot
        blob, raw_bytes = pack(header, arrays, KEYFRAME_LEVEL if keyframe else DELTA_LEVEL)
        if keyframe:
            self._keyframe_bytes, self._bytes_since_keyframe = raw_bytes, 0
        else:
            self._bytes_since_keyframe += raw_bytes
        return keyframe, blob

    def _block_deltas(self, snapshot: CacheSnapshot) -> dict[str, np.ndarray]:
        arrays = {}
        blocks, before = snapshot.blocks, self._previous.blocks
        changes = blocks.changes
        if (changes is not None and blocks.version is not None and before.version is not None
                and blocks.version == (before.version[0], before.version[1] + 1)):
            # The engine says what changed since the frame encoded last: no pass over the whole pool.
            if changes.indices.size:
                at = changes.indices.astype(np.int32)
                for name, values in zip(BLOCK_ARRAYS, changes.values, strict=True):
                    arrays[name + ".at"], arrays[name] = at, values
            return arrays
        for name in BLOCK_ARRAYS:
            new, old = getattr(snapshot, name), getattr(self._previous, name)
            changed = np.flatnonzero(new != old).astype(np.int32)
            if changed.size:
                arrays[name + ".at"] = changed
                arrays[name] = new[changed]
        return arrays

    def _encode_requests(self, snapshot: CacheSnapshot, header: dict) -> dict[str, np.ndarray]:
        # Read as columns: a step's views are not built for the log (engine/request_columns.py).
        order, *columns = snapshot.request_columns(("request_id", *COUNTER_FIELDS, *_OTHER_FIELDS))
        counters = np.array(columns[:len(COUNTER_FIELDS)], dtype=np.int64).T
        others = list(zip(*columns[len(COUNTER_FIELDS):])) if order else []
        previous_order, previous_counters, previous_others = (self._previous_order, self._previous_counters,
                                                              self._previous_others)
        self._previous_order, self._previous_counters, self._previous_others = order, counters, others
        if order == previous_order:     # the usual step: compared row by row, counters as one matrix
            old_counters, old_others = previous_counters, previous_others
        else:
            header["order"] = order
            where = {rid: i for i, rid in enumerate(previous_order or ())}
            before = [where.get(rid) for rid in order]
            known = [i for i, b in enumerate(before) if b is not None]
            old_counters = np.zeros_like(counters)     # a request new to this frame counts from zero
            if known:
                old_counters[known] = previous_counters[[before[i] for i in known]]
            old_others = [None if b is None else previous_others[b] for b in before]
        deltas = counters - old_counters
        other_changed = [i for i, (new, old) in enumerate(zip(others, old_others)) if new != old]
        moved = deltas.any(axis=1)
        if other_changed:
            moved[other_changed] = True
        changed = np.flatnonzero(moved)
        if not changed.size:
            return {}
        header["counters"] = COUNTER_FIELDS
        header["changes"] = {str(i): _other_changes(old_others[i], others[i]) for i in other_changed}
        deltas = deltas[changed]
        # The smallest type that holds them (a decode step's are 0s and 1s): less for zlib to read; the header
        # names the type, so a reader takes any.
        small = deltas.astype(np.int8)
        return {"changed": changed.astype(np.int32),
                "counter_deltas": small if np.array_equal(small, deltas) else deltas.astype(np.int32)}


class SnapshotDecoder:
    """Applies one run's frames in order; ``snapshot()`` rebuilds the current CacheSnapshot.

    Seeking applies many frames and builds one snapshot, so the two are separate.
    """

    def __init__(self) -> None:
        self._layout: dict | None = None
        self._step = -1
        self._host = (0, 0)
        self._arrays: dict[str, np.ndarray] = {}
        self._order: list[str] = []
        # The requests' counter fields, a row each in ``_order``'s order (a seek applies hundreds of frames, each
        # moving every running request's counters: one array operation a frame), and their other fields.
        self._counter_names: list[str] = []
        self._counters = np.zeros((0, 0), dtype=np.int64)
        self._fields: dict[str, dict] = {}
        self._views: dict[str, RequestView] = {}    # built views of requests unchanged since

    @property
    def step(self) -> int:
        return self._step

    def copy(self) -> SnapshotDecoder:
        """A decoder standing where this one does, that goes on apart from it."""
        twin = object.__new__(SnapshotDecoder)
        vars(twin).update(vars(self))   # the layout, order and counter names are replaced, never changed in place
        twin._arrays = {name: array.copy() for name, array in self._arrays.items()}
        twin._counters = self._counters.copy()
        twin._fields = {request_id: dict(fields) for request_id, fields in self._fields.items()}
        twin._views = dict(self._views)
        return twin

    def apply(self, blob: bytes) -> CacheSnapshot:
        self.advance(blob)
        return self.snapshot()

    def advance(self, blob: bytes) -> None:
        header, arrays = unpack(blob)
        if "num_blocks" in header:
            self._layout = {k: header[k] for k in ("block_size", "num_blocks", "allocator")}
            self._layout["kv_cache_groups"] = tuple(KVCacheGroup(tuple(layers), window)
                                                    for layers, window in header.get("groups", ()))
            self._arrays = {name: arrays[name].copy() for name in BLOCK_ARRAYS}
            self._fields, self._views, self._order = {}, {}, []
            self._counter_names, self._counters = [], np.zeros((0, 0), dtype=np.int64)
        elif self._layout is None:
            raise ValueError("snapshot stream does not start with a keyframe")
        else:
            for name in BLOCK_ARRAYS:
                if name in arrays:
                    self._arrays[name][arrays[name + ".at"]] = arrays[name]
        self._step, self._host = header["step"], tuple(header["host"])
        self._apply_requests(header, arrays)

    def _apply_requests(self, header: dict, arrays: dict[str, np.ndarray]) -> None:
        if "order" in header:
            self._reorder(header["order"])
        if "changed" not in arrays:
            return
        changed, columns = arrays["changed"], self._counter_columns(header["counters"])   # columns may grow the array
        self._counters[changed[:, None], columns] += arrays["counter_deltas"]
        order, views = self._order, self._views
        if views:   # none while a seek applies frame after frame
            for position in changed.tolist():
                views.pop(order[position], None)
        # Only the requests whose other fields changed: a request new to the frame has them all here.
        for position, named in header["changes"].items():
            request_id = order[int(position)]
            fields = self._fields.setdefault(request_id, {"request_id": request_id})
            for name, value in named.items():
                if name.startswith("+"):
                    name = name[1:]
                    value = [old + tuple(tail) for old, tail in zip(fields[name], value, strict=True)]
                if name in TABLE_FIELDS:
                    value = tuple(tuple(t) for t in value)
                elif name == "group_block_tables":   # per sample, per group: JSON gives lists
                    value = tuple(tuple(tuple(t) for t in tables) for tables in value)
                fields[name] = value

    def _reorder(self, order: list[str]) -> None:
        """The requests now in ``order``: a request new to it counts from zero, as the encoder's deltas do."""
        where = {rid: i for i, rid in enumerate(self._order)}
        counters = np.zeros((len(order), len(self._counter_names)), dtype=np.int64)
        known = [(i, where[rid]) for i, rid in enumerate(order) if rid in where]
        if known:
            now, before = zip(*known)
            counters[list(now)] = self._counters[list(before)]
        self._order, self._counters = order, counters
        self._fields = {rid: self._fields[rid] for rid in order if rid in self._fields}

    def _counter_columns(self, names: list[str]) -> list[int]:
        """The counters' columns for a frame's ``names`` (a log's writer names its counters in each frame)."""
        missing = [name for name in names if name not in self._counter_names]
        if missing:
            self._counter_names = [*self._counter_names, *missing]
            self._counters = np.hstack([self._counters, np.zeros((len(self._order), len(missing)), np.int64)])
        return [self._counter_names.index(name) for name in names]

    def _view(self, request_id: str, row: int) -> RequestView:
        view = self._views.get(request_id)
        if view is None:
            counters = zip(self._counter_names, self._counters[row].tolist(), strict=True)
            view = self._views[request_id] = RequestView(**self._fields[request_id], **dict(counters))
        return view

    def snapshot(self) -> CacheSnapshot:
        if self._layout is None:
            raise ValueError("no frame applied yet")
        arrays = {}
        for name, array in self._arrays.items():
            arrays[name] = array.copy()
            arrays[name].flags.writeable = False
        self._views = {rid: view for rid, view in self._views.items() if rid in self._fields}
        return CacheSnapshot(
            step=self._step, **self._layout, **arrays,
            requests=tuple(self._view(rid, row) for row, rid in enumerate(self._order)),
            num_host_blocks=self._host[0], num_free_host_blocks=self._host[1],
        )
