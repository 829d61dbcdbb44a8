"""The inspector and the block table name each block's KV-cache group, and say which entries left the window."""

from __future__ import annotations

from kvscope.app.widgets.block_inspector import describe_block
from kvscope.app.widgets.block_table import describe_request
from kvscope.engine import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.kv_cache_groups import KVCacheGroup

GROUPS = (KVCacheGroup((0, 2), None), KVCacheGroup((1, 3), 8))


def decoding_snapshot():
    """A request 40 tokens in, with a window of 8 tokens in blocks of 4: its sliding table starts freed."""
    engine = fake_engine(EngineConfig(block_size=4), num_blocks=64, max_model_len=128, kv_cache_groups=GROUPS)
    engine.add_request(list(range(30)), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for _ in range(10):
        snapshot = engine.step().snapshot
    return snapshot


def test_the_inspector_names_the_group_of_a_block():
    snapshot = decoding_snapshot()
    view = snapshot.requests[0]
    full, sliding = view.group_block_tables[0]
    assert "group 0 (full, layers 0,2)" in describe_block(snapshot, full[0]).plain
    assert "group 1 (sliding 8, layers 1,3)" in describe_block(snapshot, sliding[-1]).plain
    assert "logical" in describe_block(snapshot, sliding[-1]).plain


def test_the_block_table_shows_a_line_per_group_and_the_entries_that_left_the_window():
    snapshot = decoding_snapshot()
    text = describe_request(snapshot.requests[0], snapshot)
    lines = text.splitlines()
    assert "group 0 (full" in lines[1] and "left the window" not in lines[1]
    assert "group 1 (sliding 8" in lines[2] and "left the window" in lines[2]
