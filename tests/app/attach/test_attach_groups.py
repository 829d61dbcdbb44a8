"""KV-cache groups in `kvscope attach`: vLLM 0.32's events name each block's group (BlockStored: group_idx, the
group's kind and window; BlockRemoved: group_idx). The pool keeps each group's blocks apart (a hybrid server
announces one prefix once per group) and counts them; the events panel names the groups, or says in one line that
the events name none."""

from __future__ import annotations

import msgspec
from test_attach_pool import check_invariants, replay
from vllm_fakes import SHARED

from kvscope.app.attach.feed.events import BatchDecoder
from kvscope.app.attach.feed.groups import NO_GROUP_NOTE, GroupSeen
from kvscope.app.attach.feed.pool import PoolModel
from kvscope.app.attach.feed.pool_view import PoolPicture
from kvscope.app.attach.window.widgets.events_panel import describe_groups

BS = 4


def stored(hashes, parent=None, **group) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(range(BS * len(hashes))), "block_size": BS, "lora_id": None, "medium": "GPU", **group}


def removed(hashes, **group) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **group}


def apply(pool: PoolModel, *events) -> None:
    pool.apply(BatchDecoder().decode(msgspec.msgpack.encode([1.0, list(events), None])).events)
    check_invariants(pool)


def view(pool: PoolModel):
    return PoolPicture(pool, "rank 0").view(1, None)


def test_a_recorded_vllm_run_names_its_one_group_full_attention():
    pool = PoolModel(96, 32)
    replay(SHARED / "kv-events.frames.jsonl", pool)
    assert pool.groups.named
    assert pool.groups.groups() == (GroupSeen(0, "full_attention", None, pool.num_known_blocks),)
    line = describe_groups(view(pool), name_pool=False)
    assert line == f"KV-cache groups (blocks announced): 0 full attention {pool.num_known_blocks}"


def test_a_hybrid_servers_groups_keep_their_blocks_apart_and_are_counted():
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    sliding = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 512}
    pool = PoolModel(32, BS)
    # The same prefix, announced once per group: two blocks each, none a duplicate of the other group's.
    apply(pool, stored([11, 12], **full), stored([11, 12], **sliding), stored([13], parent=12, **sliding))
    assert pool.num_known_blocks == 5 and pool.counters.num_duplicates == 0
    assert [(g.name, g.num_blocks) for g in pool.groups.groups()] == [("full attention", 2),
                                                                    ("sliding window 512", 3)]
    # The sliding group's first block left its window and was evicted: the full group's block of that hash stays.
    apply(pool, removed([11], group_idx=1))
    assert [g.num_blocks for g in pool.groups.groups()] == [2, 2] and pool.counters.num_unknown_removed == 0
    line = describe_groups(view(pool), name_pool=True)
    assert line == "rank 0: KV-cache groups (blocks announced): 0 full attention 2 · 1 sliding window 512 2"
    apply(pool, {"type": "AllBlocksCleared"})
    assert [g.num_blocks for g in pool.groups.groups()] == [0, 0]


def test_events_that_name_no_group_are_said_to_in_one_line():
    pool = PoolModel(32, BS)
    apply(pool, stored([21, 22]))       # a release whose events carry no group fields
    assert not pool.groups.named and pool.groups.groups() == ()
    assert describe_groups(view(pool), name_pool=False) == f"[dim]{NO_GROUP_NOTE}[/]"
    # The older tagged-array encoding cannot carry them either.
    tagged = ["BlockStored", [31], None, list(range(BS)), BS, None, "GPU"]
    pool.apply(BatchDecoder().decode(msgspec.msgpack.encode([1.0, [tagged], None])).events)
    assert pool.num_known_blocks == 3 and not pool.groups.named
