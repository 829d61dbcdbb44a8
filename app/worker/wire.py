"""The engine process's messages as bytes: what crosses the pipe between the engine and the window.

With the engine in a process of its own (app/worker/process.py), everything the engine thread posts is pickled
here and rebuilt on the window's side as the same message. A busy engine sends ten batches a second, and what
it sends whole grows with the pool and with the requests' lengths, so three things are sent as changes:

- a step's block arrays: the blocks it changed (engine/block_changes.py's BlockChanges), applied on the window's
  side to the version before, so the window keeps the same chain of versions the engine does. Whole arrays go
  only where the chain starts or breaks (the first step of an engine, a look between steps). The changes of a
  batch's steps travel packed in one set of arrays: pickling five small arrays a step cost more than the rest of
  the step together;
- a request view's block tables: what a table gained since the last step that carried views. For a request with
  one sample and one KV-cache group the engine promises that its table only grows until it is preempted
  (RequestView's doc; the engine's invariant tests hold it to that), so its length is all the proof needed; any
  other table is compared with what was sent, and sent whole where it changed otherwise;
- a view's prompt preview (most of a view's bytes): only with a request's first view.

Both ends keep what the other holds (the last version, the tables last sent), so the bytes must be decoded in the
order they were encoded, every one: a pipe does that. A new engine (EngineReady) starts the tables afresh.

A step the window will not draw (a thinned one: app/worker/step_posting.py) is encoded as it is thinned, when it
joins its batch, and waits in its batch as an EncodedStep: its objects are read while they are still in the cache,
and only its wire form stays alive. Encoded when their post was sent, a post's steps cost it 14.6 microseconds
each (256 requests, 330,000 blocks), as much as the rest of the post; encoded as they join, 10 are left to it.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from kvscope.app.messages import EngineReady, EngineStepped, StepBatch, StepsReady
from kvscope.engine.block_changes import KEYFRAME_VERSIONS, BlockArrays, BlockChanges
from kvscope.engine.outputs import CacheSnapshot, RequestView, StepResult, StepStats

_FIELDS = RequestView._fields
_ID, _ARRIVAL, _TABLES, _PREEMPTIONS, _SAMPLES, _PREVIEW, _GROUPS = (
    _FIELDS.index(name) for name in ("request_id", "arrival_index", "block_tables", "num_preemptions",
                                     "num_samples", "prompt_preview", "group_block_tables"))
_STATS_FIELDS = tuple(field.name for field in dataclasses.fields(StepStats))
_SAME, _GROWN, _WHOLE = 0, 1, 2    # how a view's tables are sent
_UNCHANGED = (_SAME,)
_PACKED = -1                       # where a step's block changes are: in the message's packed arrays


class WireError(RuntimeError):
    """The bytes do not follow from what was decoded before them."""


class EncodedStep:
    """A thinned step in its wire form, waiting in its batch to be sent (``MessageEncoder.thin_step``)."""

    __slots__ = ("wire", "changes")

    def __init__(self, wire: tuple, changes: list[BlockChanges]) -> None:
        self.wire = wire
        self.changes = changes      # its block changes, packed with the message's when it is sent


class MessageEncoder:
    """The engine's side: ``encode(message)`` gives the bytes ``MessageDecoder.decode`` turns back into it. A
    batch's steps may be encoded before it (``thin_step``), in their order, and nothing else between."""

    def __init__(self) -> None:
        self._version: tuple[int, int] | None = None     # the last block version sent as part of the chain
        # Request id: (arrival index, preemptions, tables or the one table's length, preview), as the last step
        # with views sent them.
        self._sent: dict[str, tuple] = {}
        self._packing: list[BlockChanges] = []            # the changes of the message being encoded
        self._whole = False         # block arrays were encoded whole since the last message
        self.sent_whole = False     # the last message carried block arrays whole: a one-off, the chain broke

    def encode(self, message) -> bytes:
        self._packing = []
        if isinstance(message, StepsReady):
            body = ("steps", [self._sent_step(stepped.result) for stepped in message.batch.take()])
        else:
            if isinstance(message, EngineReady):
                self._sent = {}
            fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
            if "snapshot" in fields:
                fields["snapshot"] = self._snapshot(fields["snapshot"])
            body = ("message", type(message), fields)
        self.sent_whole, self._whole = self._whole, False
        return pickle.dumps((body, _pack(self._packing)), protocol=pickle.HIGHEST_PROTOCOL)

    def thin_step(self, result: StepResult) -> EncodedStep:
        """``result`` without its request views, encoded now: the next step of the batch being built."""
        self._packing = []
        wire = self._step(result, views=False)
        return EncodedStep(wire, self._packing)

    def restore_views(self, step: EncodedStep, snapshot: CacheSnapshot) -> EncodedStep:
        """``step`` with the request views of ``snapshot`` (the engine's between steps, for a post it did not
        foresee: app/worker/step_posting.py)."""
        outputs, stats, wire_snapshot, events, kv_events = step.wire
        views = self._views(snapshot)
        return EncodedStep((outputs, stats, (*wire_snapshot[:5], views, *wire_snapshot[6:]), events, kv_events),
                           step.changes)

    def _sent_step(self, result) -> tuple:
        if type(result) is EncodedStep:
            self._packing.extend(result.changes)
            return result.wire
        return self._step(result)

    def _step(self, result: StepResult, views: bool = True) -> tuple:
        # The stats as their values: pickled whole, each step's carried its fields' names again.
        return (result.outputs, tuple(vars(result.stats).values()), self._snapshot(result.snapshot, views),
                result.events, result.kv_events)

    def _snapshot(self, snapshot: CacheSnapshot, views: bool = True) -> tuple:
        return (snapshot.step, snapshot.block_size, snapshot.num_blocks, snapshot.allocator,
                self._blocks(snapshot.blocks), self._views(snapshot) if views else None, snapshot.num_host_blocks,
                snapshot.num_free_host_blocks, snapshot.kv_cache_groups)

    def _blocks(self, blocks: BlockArrays) -> tuple:
        version = blocks.version
        follows = (version is not None and self._version is not None and blocks.changes is not None
                   and version == (self._version[0], self._version[1] + 1))
        if version is not None:
            self._version = version
        if follows:
            self._packing.append(blocks.changes)
            return (version, _PACKED)
        # A look between steps (no version) holds changes since a version the window may not have: sent whole.
        self._whole = True
        return (version, blocks.arrays())

    def _views(self, snapshot: CacheSnapshot) -> list[list] | None:
        """None for a thinned step (no views); else the views as columns (RequestView's fields, read without
        building the views), the tables and previews as changes (see the module's doc)."""
        if not snapshot.num_requests:
            return None
        columns = snapshot.request_columns(_FIELDS)
        before, now = self._sent, {}
        changes, previews = [], []
        for request_id, arrival, preemptions, tables, samples, groups, preview in zip(
                columns[_ID], columns[_ARRIVAL], columns[_PREEMPTIONS], columns[_TABLES], columns[_SAMPLES],
                columns[_GROUPS], columns[_PREVIEW]):
            # A table the engine promises only grows is remembered by its length: holding the table itself kept
            # it alive past the engine's next growth, to be freed here, cache-cold.
            grows = samples == 1 and not groups and len(tables) == 1
            sent = before.get(request_id)
            if sent is None or sent[0] != arrival:      # new, or a new request under a finished one's id
                changes.append((_WHOLE, tables))
                previews.append(preview)
            else:
                if grows and sent[1] == preemptions and type(sent[2]) is int:
                    tail = tables[0][sent[2]:]
                    changes.append((_GROWN, (tail,)) if tail else _UNCHANGED)
                else:
                    changes.append(_table_changes(sent[2], tables))
                previews.append(None if sent[3] == preview else preview)
            now[request_id] = (arrival, preemptions, len(tables[0]) if grows else tables, preview)
        self._sent = now
        columns[_TABLES], columns[_PREVIEW] = changes, previews
        return columns


def _table_changes(before, now: tuple) -> tuple:
    """How ``now`` (a view's tables, one per sample) is sent against ``before`` (the tables last sent, or the
    length of the one table the engine promised would only grow): the same, grown, or whole."""
    if type(before) is int or len(before) != len(now):
        return (_WHOLE, now)
    tails = []
    for old, new in zip(before, now):
        if new is old:      # a table the engine did not touch is the same object
            tails.append(())
        elif len(new) >= len(old) and new[:len(old)] == old:
            tails.append(new[len(old):])
        else:
            return (_WHOLE, now)
    return (_GROWN, tuple(tails)) if any(tails) else _UNCHANGED


def _pack(changes: list[BlockChanges]) -> tuple | None:
    """The block changes of several steps as one array of indices and one per value array, with each step's
    length."""
    if not changes:
        return None
    lengths = [len(c.indices) for c in changes]
    return (lengths, np.concatenate([c.indices for c in changes]),
            tuple(np.concatenate(column) for column in zip(*(c.values for c in changes))))


def _unpack(packed: tuple | None) -> list[BlockChanges]:
    if packed is None:
        return []
    lengths, indices, values = packed
    for array in (indices, *values):
        array.flags.writeable = False       # as the engine's own changes are
    bounds = np.cumsum(lengths)[:-1]
    return [BlockChanges(step_indices, step_values) for step_indices, *step_values in
            zip(np.split(indices, bounds), *(np.split(column, bounds) for column in values))]


class MessageDecoder:
    """The window's side of MessageEncoder: each message as it was posted, its steps in a closed StepBatch."""

    def __init__(self) -> None:
        self._latest: BlockArrays | None = None
        self._since_whole = 0
        self._held: dict[str, tuple[tuple, str]] = {}     # request id: its tables and preview as last decoded
        self._unpacked: list[BlockChanges] = []

    def decode(self, data: bytes):
        body, packed = pickle.loads(data)
        self._unpacked = _unpack(packed)[::-1]      # taken from the end, in the order they were packed
        if body[0] == "steps":
            batch = StepBatch()
            for outputs, stats, snapshot, events, kv_events in body[1]:
                batch.add(EngineStepped(StepResult(outputs, _stats(stats), self._snapshot(snapshot), events,
                                                   kv_events)))
            batch.close()
            return StepsReady(batch)
        _, kind, fields = body
        if kind is EngineReady:
            self._held = {}
        if "snapshot" in fields:
            fields["snapshot"] = self._snapshot(fields["snapshot"])
        return kind(**fields)

    def _snapshot(self, wire: tuple) -> CacheSnapshot:
        step, block_size, num_blocks, allocator, blocks, views, host_blocks, free_host, groups = wire
        return CacheSnapshot(step, block_size, num_blocks, allocator, blocks=self._blocks(*blocks),
                             requests=self._views(views), num_host_blocks=host_blocks,
                             num_free_host_blocks=free_host, kv_cache_groups=groups)

    def _blocks(self, version, sent) -> BlockArrays:
        if isinstance(sent, tuple):     # whole arrays
            blocks = BlockArrays(None, arrays=sent, version=version)
            if version is not None:
                self._latest, self._since_whole = blocks, 0
            return blocks
        latest = self._latest
        if latest is None or latest.version != (version[0], version[1] - 1):
            raise WireError(f"block version {version} does not follow "
                            f"{latest.version if latest is not None else 'nothing'}")
        blocks = BlockArrays(self._unpacked.pop(), latest, version=version)
        self._latest, self._since_whole = blocks, self._since_whole + 1
        if self._since_whole >= KEYFRAME_VERSIONS:
            blocks.arrays()     # whole again: the chain behind it is let go of, as the engine's own is
            self._since_whole = 0
        return blocks

    def _views(self, columns: list[list] | None) -> tuple[RequestView, ...]:
        if columns is None:
            return ()
        held, now = self._held, {}
        tables, previews = [], []
        for request_id, changes, preview in zip(columns[_ID], columns[_TABLES], columns[_PREVIEW]):
            before = held.get(request_id)
            table = _apply_table_changes(before[0] if before is not None else None, changes)
            if preview is None:
                if before is None:
                    raise WireError(f"request {request_id}'s preview was never sent")
                preview = before[1]
            tables.append(table)
            previews.append(preview)
            now[request_id] = (table, preview)
        self._held = now
        columns[_TABLES], columns[_PREVIEW] = tables, previews
        return tuple(map(RequestView._make, zip(*columns)))


def _stats(values: tuple) -> StepStats:
    stats = object.__new__(StepStats)
    vars(stats).update(zip(_STATS_FIELDS, values, strict=True))
    return stats


def _apply_table_changes(before: tuple | None, changes: tuple) -> tuple:
    how = changes[0]
    if how == _WHOLE:
        return changes[1]
    if before is None:
        raise WireError("a table's changes came for a request never sent whole")
    if how == _SAME:
        return before
    return tuple(old + tail if tail else old for old, tail in zip(before, changes[1], strict=True))
