"""Decoding vLLM's KV-event payloads: both encodings, recorded from real servers, and bad input."""

from __future__ import annotations

import msgspec
import pytest
from vllm_fakes import SHARED, recorded_payloads

from kvscope.app.attach.feed.events import (
    CLEARED,
    REMOVED,
    STORED,
    BatchDecoder,
    MalformedPayload,
    TaggedBlockStored,
    is_on_device,
)

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


def as_tagged_array(payload: bytes) -> bytes:
    """The same batch as older vLLM encoded it: each event an array, its type name first."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    tagged = []
    for event in events:
        kind = event["type"]
        if kind == "BlockStored":
            tagged.append([kind, *(event.get(name) for name in STORED_FIELDS)])
        elif kind == "BlockRemoved":
            tagged.append([kind, event["block_hashes"], event.get("medium")])
        else:
            tagged.append([kind])
    return msgspec.msgpack.encode([ts, tagged, rank])


def kinds(batch) -> list[str]:
    return ["stored" if isinstance(e, STORED) else "removed" if isinstance(e, REMOVED) else "cleared"
            for e in batch.events]


def test_the_recorded_run_decodes_to_its_75_stores_and_284_removals():
    decoder = BatchDecoder()
    batches = [decoder.decode(p) for p in recorded_payloads()]
    counted = [k for batch in batches for k in kinds(batch)]
    assert len(batches) == 87
    assert counted.count("stored") == 75 and counted.count("removed") == 284
    first = batches[0].events[0]
    assert len(first.block_hashes) == 20 and first.parent_block_hash is None
    assert len(msgspec.msgpack.decode(first.token_ids)) == 20 * 32      # kept encoded until a preview needs it
    assert first.block_size == 32 and first.medium == "GPU"
    assert all(b.data_parallel_rank == 0 and not b.unknown for b in batches)


def test_all_blocks_cleared_from_the_dev_mode_run():
    batches = [BatchDecoder().decode(p) for p in recorded_payloads(SHARED / "run2" / "kv-events.frames.jsonl")]
    cleared = [i for i, batch in enumerate(batches) if any(isinstance(e, CLEARED) for e in batch.events)]
    assert cleared == [3]   # seq 3: the reset, then the next request storing its prompt again
    assert kinds(batches[3])[:2] == ["cleared", "stored"]


def test_the_tagged_array_encoding_decodes_to_the_same_events():
    payloads = recorded_payloads()
    decoder = BatchDecoder()
    for payload in payloads:
        as_map, as_array = decoder.decode(payload), decoder.decode(as_tagged_array(payload))
        assert kinds(as_map) == kinds(as_array)
        for a, b in zip(as_map.events, as_array.events):
            assert a.block_hashes == b.block_hashes
            if isinstance(a, STORED):
                assert isinstance(b, TaggedBlockStored)
                assert (a.parent_block_hash, a.token_ids, a.block_size) == \
                       (b.parent_block_hash, b.token_ids, b.block_size)


def test_an_old_tagged_array_without_medium_and_bytes_hashes():
    payload = msgspec.msgpack.encode([1.5, [["BlockStored", [b"\x01" * 32], None, [1, 2], 2, None],
                                            ["BlockRemoved", [b"\x01" * 32]], ["AllBlocksCleared"]]])
    batch = BatchDecoder().decode(payload)
    assert kinds(batch) == ["stored", "removed", "cleared"]
    assert batch.events[0].block_hashes == [b"\x01" * 32] and batch.data_parallel_rank is None
    assert is_on_device(batch.events[0])


def test_unknown_event_kinds_are_counted_and_the_known_ones_kept():
    payload = msgspec.msgpack.encode([2.0, [
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1], "block_size": 1},
        {"type": "BlockPinned", "block_hashes": [7]},
        ["SomethingNew", 1, 2],
        {"no_type": True},
        {"type": "BlockRemoved", "block_hashes": "not a list"},
    ], 0])
    batch = BatchDecoder().decode(payload)
    assert kinds(batch) == ["stored"]
    assert batch.unknown == {"BlockPinned": 1, "SomethingNew": 1, "untyped": 1, "BlockRemoved": 1}


@pytest.mark.parametrize("payload", [b"", b"\x01", b"\xc1", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, "events", 0]),
                                     msgspec.msgpack.encode(["not a time", [], 0])])
def test_a_payload_that_is_not_a_batch_is_malformed(payload):
    with pytest.raises(MalformedPayload):
        BatchDecoder().decode(payload)


def test_events_for_another_tier_are_not_on_the_device():
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                             "token_ids": [1], "block_size": 1, "medium": "CPU"}], 0])
    assert not is_on_device(BatchDecoder().decode(payload).events[0])
