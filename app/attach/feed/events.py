"""vLLM's KV-cache event payloads, decoded with msgspec into typed records.

A payload is msgpack ``[ts, [events], dp_rank]``. vLLM has sent each event in
two encodings: newer releases as a map with a ``"type"`` key, older ones as a
tagged array ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium]``. msgspec cannot mix the two in one union, so a
payload is tried against the map schema, then the array schema; both decode
straight into Structs, which is what keeps 10,000 events/s cheap.

A payload neither schema accepts whole (an event type this kvscope does not know,
a field of the wrong type) is taken apart event by event: the events that decode
are kept, the others are counted by kind. Only a payload that is not a batch at
all is malformed. Nothing here raises anything but ``MalformedPayload``.

Block hashes are ints (vLLM 0.32 folds its sha256 into 64 bits) or bytes (other
releases); both are kept as they came, since both are hashable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

BlockHash = int | bytes

# The medium vLLM tags device-pool blocks with; blocks offloaded to another tier are not in the device pool.
DEVICE_MEDIA = (None, "GPU")


class StoredFields(msgspec.Struct):
    """A block (or a run of blocks) became full and entered the prefix cache.

    ``token_ids`` stays encoded: the pool decodes it only for the few blocks whose text it previews,
    which keeps decoding from being most of the cost of an event."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class RemovedFields(msgspec.Struct):
    """Blocks were evicted from the prefix cache (vLLM sends nothing when a request merely finishes)."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class BlockStored(StoredFields, tag_field="type", tag="BlockStored"):
    # vLLM 0.32 names the KV-cache group and its kind (app/attach/feed/groups.py); only the map encoding can
    # carry them: in the tagged arrays other fields come first.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(RemovedFields, tag_field="type", tag="BlockRemoved"):
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class TaggedBlockStored(StoredFields, array_like=True, tag="BlockStored"):
    pass


class TaggedBlockRemoved(RemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class TaggedAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
TaggedEvent = TaggedBlockStored | TaggedBlockRemoved | TaggedAllBlocksCleared
STORED = (BlockStored, TaggedBlockStored)
REMOVED = (BlockRemoved, TaggedBlockRemoved)
CLEARED = (AllBlocksCleared, TaggedAllBlocksCleared)


class MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: int | None = None


class TaggedBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[TaggedEvent]
    data_parallel_rank: int | None = None


class RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class MalformedPayload(ValueError):
    """The payload is not a KV-event batch at all."""


@dataclass(frozen=True)
class DecodedBatch:
    ts: float
    data_parallel_rank: int | None
    events: list                         # STORED, REMOVED and CLEARED records, in order
    unknown: dict[str, int] = field(default_factory=dict)   # kind -> events of it that were skipped


_DECODE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)
_map_batch = msgspec.msgpack.Decoder(MapBatch)
_tagged_batch = msgspec.msgpack.Decoder(TaggedBatch)
_raw_batch = msgspec.msgpack.Decoder(RawBatch)
_map_event = msgspec.msgpack.Decoder(MapEvent)
_tagged_event = msgspec.msgpack.Decoder(TaggedEvent)
_any = msgspec.msgpack.Decoder()


class BatchDecoder:
    """Decodes payloads, trying first the encoding the last payload used."""

    def __init__(self) -> None:
        self._decoders = [_map_batch, _tagged_batch]

    def decode(self, payload: bytes) -> DecodedBatch:
        for index, decoder in enumerate(self._decoders):
            try:
                batch = decoder.decode(payload)
            except _DECODE_ERRORS:
                continue
            if index:
                self._decoders.reverse()
            return DecodedBatch(batch.ts, batch.data_parallel_rank, batch.events)
        return _decode_event_by_event(payload)


def _decode_event_by_event(payload: bytes) -> DecodedBatch:
    try:
        batch = _raw_batch.decode(payload)
    except _DECODE_ERRORS as exc:
        raise MalformedPayload(f"not a KV-event batch: {exc}") from None
    events, unknown = [], {}
    for raw in batch.events:
        event = _decode_event(raw)
        if event is None:
            kind = _kind_of(raw)
            unknown[kind] = unknown.get(kind, 0) + 1
        else:
            events.append(event)
    return DecodedBatch(batch.ts, batch.data_parallel_rank, events, unknown)


def _decode_event(raw: msgspec.Raw):
    for decoder in (_map_event, _tagged_event):
        try:
            return decoder.decode(raw)
        except _DECODE_ERRORS:
            continue
    return None


def _kind_of(raw: msgspec.Raw) -> str:
    """The event's type name if it has one (map "type" or array tag), for the count of skipped kinds."""
    try:
        value = _any.decode(raw)
    except _DECODE_ERRORS:
        return "undecodable"
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        return value["type"][:40]
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0][:40]
    return "untyped"


def is_on_device(event) -> bool:
    """Whether a stored or removed event concerns the device pool (not a CPU or storage tier)."""
    return event.medium in DEVICE_MEDIA
