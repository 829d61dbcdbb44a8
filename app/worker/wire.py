"""The engine process's messages as bytes: what crosses the pipe between the engine and the window.

With the engine in a process of its own (app/worker/process.py), everything the engine thread posts is pickled
here and rebuilt on the window's side as the same message. Two things are sent as changes, not whole, because
whole they grow with the pool and with the requests' lengths, and a busy engine sends twenty batches a second:

- a step's block arrays: the blocks it changed (engine/block_changes.py's BlockChanges), applied on the window's
  side to the version before, so the window keeps the same chain of versions the engine does. Whole arrays go
  only where the chain starts or breaks (the first step of an engine, a look between steps);
- a request view's block tables: only the blocks a table gained since the last step that carried views, or the
  table whole where it changed otherwise (a preemption, a swap).

Both ends keep what the other holds (the last version, the tables last sent), so the bytes must be decoded in the
order they were encoded, every one: a pipe does that.
"""

from __future__ import annotations

import dataclasses
import pickle

from kvscope.app.messages import EngineStepped, StepBatch, StepsReady
from kvscope.engine.block_changes import KEYFRAME_VERSIONS, BlockArrays
from kvscope.engine.outputs import CacheSnapshot, RequestView, StepResult

_BLOCK_TABLES = RequestView._fields.index("block_tables")
_SAME, _GROWN, _WHOLE = 0, 1, 2    # how a view's tables are sent


class WireError(RuntimeError):
    """The bytes do not follow from what was decoded before them."""


class MessageEncoder:
    """The engine's side: ``encode(message)`` gives the bytes ``MessageDecoder.decode`` turns back into it."""

    def __init__(self) -> None:
        self._version: tuple[int, int] | None = None     # the last block version sent as part of the chain
        self._tables: dict[str, tuple] = {}               # request id: its block tables as last sent

    def encode(self, message) -> bytes:
        if isinstance(message, StepsReady):
            body = ("steps", [self._step(stepped.result) for stepped in message.batch.take()])
        else:
            fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
            if "snapshot" in fields:
                fields["snapshot"] = self._snapshot(fields["snapshot"])
            body = ("message", type(message), fields)
        return pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)

    def _step(self, result: StepResult) -> tuple:
        return (result.outputs, result.stats, self._snapshot(result.snapshot), result.events, result.kv_events)

    def _snapshot(self, snapshot: CacheSnapshot) -> tuple:
        return (snapshot.step, snapshot.block_size, snapshot.num_blocks, snapshot.allocator,
                self._blocks(snapshot.blocks), self._views(snapshot), snapshot.num_host_blocks,
                snapshot.num_free_host_blocks, snapshot.kv_cache_groups)

    def _blocks(self, blocks: BlockArrays) -> tuple:
        version = blocks.version
        follows = (version is not None and self._version is not None and blocks.changes is not None
                   and version == (self._version[0], self._version[1] + 1))
        if version is not None:
            self._version = version
        if follows:
            return (version, blocks.changes, None)
        # A look between steps (no version) holds changes since a version the window may not have: sent whole.
        return (version, None, blocks.arrays())

    def _views(self, snapshot: CacheSnapshot) -> list[list] | None:
        """None for a thinned step (no views); else the views as columns (RequestView's fields, read without
        building the views), the tables as changes (see the module's doc)."""
        if not snapshot.num_requests:
            return None
        columns = snapshot.request_columns(RequestView._fields)
        ids, tables = columns[0], columns[_BLOCK_TABLES]
        sent = self._tables
        columns[_BLOCK_TABLES] = [_table_changes(sent.get(request_id), now) for request_id, now in zip(ids, tables)]
        self._tables = dict(zip(ids, tables))
        return columns


def _table_changes(before: tuple | None, now: tuple) -> tuple:
    """How ``now`` (a view's tables, one per sample) is sent against ``before``: the same, grown, or whole. A
    table the engine did not touch is the same object, so most of a step's tables cost one identity test."""
    if before is not None and len(before) == len(now):
        tails = []
        for old, new in zip(before, now):
            if new is old:
                tails.append(())
            elif len(new) >= len(old) and new[:len(old)] == old:
                tails.append(new[len(old):])
            else:
                return (_WHOLE, now)
        return (_GROWN, tuple(tails)) if any(tails) else (_SAME,)
    return (_WHOLE, now)


class MessageDecoder:
    """The window's side of MessageEncoder: each message as it was posted, its steps in a closed StepBatch."""

    def __init__(self) -> None:
        self._latest: BlockArrays | None = None
        self._since_whole = 0
        self._tables: dict[str, tuple] = {}

    def decode(self, data: bytes):
        body = pickle.loads(data)
        if body[0] == "steps":
            batch = StepBatch()
            for outputs, stats, snapshot, events, kv_events in body[1]:
                batch.add(EngineStepped(StepResult(outputs, stats, self._snapshot(snapshot), events, kv_events)))
            batch.close()
            return StepsReady(batch)
        _, kind, fields = body
        if "snapshot" in fields:
            fields["snapshot"] = self._snapshot(fields["snapshot"])
        return kind(**fields)

    def _snapshot(self, wire: tuple) -> CacheSnapshot:
        step, block_size, num_blocks, allocator, blocks, views, host_blocks, free_host, groups = wire
        return CacheSnapshot(step, block_size, num_blocks, allocator, blocks=self._blocks(*blocks),
                             requests=self._views(views), num_host_blocks=host_blocks,
                             num_free_host_blocks=free_host, kv_cache_groups=groups)

    def _blocks(self, version, changes, arrays) -> BlockArrays:
        if arrays is not None:
            blocks = BlockArrays(None, arrays=arrays, version=version)
            if version is not None:
                self._latest, self._since_whole = blocks, 0
            return blocks
        latest = self._latest
        if latest is None or latest.version != (version[0], version[1] - 1):
            raise WireError(f"block version {version} does not follow "
                            f"{latest.version if latest is not None else 'nothing'}")
        blocks = BlockArrays(changes, latest, version=version)
        self._latest, self._since_whole = blocks, self._since_whole + 1
        if self._since_whole >= KEYFRAME_VERSIONS:
            blocks.arrays()     # whole again: the chain behind it is let go of, as the engine's own is
            self._since_whole = 0
        return blocks

    def _views(self, columns: list[list] | None) -> tuple[RequestView, ...]:
        if columns is None:
            return ()
        ids, sent = columns[0], self._tables
        tables = [_apply_table_changes(sent.get(request_id), changes)
                  for request_id, changes in zip(ids, columns[_BLOCK_TABLES])]
        self._tables = dict(zip(ids, tables))
        columns[_BLOCK_TABLES] = tables
        return tuple(map(RequestView._make, zip(*columns)))


def _apply_table_changes(before: tuple | None, changes: tuple) -> tuple:
    how = changes[0]
    if how == _WHOLE:
        return changes[1]
    if before is None:
        raise WireError("a table's changes came for a request never sent whole")
    if how == _SAME:
        return before
    return tuple(old + tail if tail else old for old, tail in zip(before, changes[1], strict=True))
