"""A tiny random Gemma 3 ([sliding, full], a 24-token window) decoding past its window: what the window lets go of
shows in the step's counters per group and in the snapshot the map draws, and the run log gives both back."""

from __future__ import annotations

import dataclasses

from invariants import run_checked
from models import WINDOW, tiny_model

from kvscope.app.runlog import RunLogReader, record_run
from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.block_pool import NULL_BLOCK
from kvscope.engine.outputs import BLOCK_USED

BS = 4
PROMPT = [(i * 37) % 3000 + 100 for i in range(30)]
DECODES = 20


def gemma3_engine() -> LLMEngine:
    model, tok = tiny_model("gemma3")
    config = EngineConfig(device="cpu", dtype="float32", block_size=BS, num_blocks=64, max_model_len=128,
                          max_num_batched_tokens=64)
    return LLMEngine(config, model=model, tokenizer=tok)


def test_a_requests_sliding_window_blocks_leave_as_it_decodes(tmp_path):
    engine = gemma3_engine()
    groups = engine.runner.kv_cache_groups
    full, sliding = (next(i for i, g in enumerate(groups) if (g.sliding_window is None) == kind) for kind in (1, 0))
    assert groups[sliding].sliding_window == WINDOW
    logger = record_run(engine, source="script", db_path=tmp_path / "runs.db")
    engine.add_request(PROMPT, SamplingParams(max_tokens=DECODES + 1, temperature=0.0, ignore_eos=True))
    results = []
    run_checked(engine, on_step=results.append)
    logger.close()

    cap = -(-WINDOW // BS) + 1
    freed_before = 0
    seen_sliding: set[int] = set()
    for result in results[1:-1]:    # the decodes (the last step finishes the request and frees everything)
        (view,) = result.snapshot.requests
        (tables,) = view.group_block_tables
        live = [block for block in tables[sliding] if block != NULL_BLOCK]
        assert len(live) <= cap, f"the sliding group holds {len(live)} blocks, more than ceil(W/B)+1 = {cap}"
        assert NULL_BLOCK not in tables[full]
        stats = result.stats
        assert stats.group_held_blocks == tuple(len([b for b in t if b != NULL_BLOCK]) for t in tables)
        assert stats.window_freed_step[sliding] == stats.window_freed_blocks[sliding] - freed_before
        assert stats.window_freed_blocks[full] == 0
        freed_before = stats.window_freed_blocks[sliding]
        # A block that left the window is back in the pool: the map draws it free.
        gone = seen_sliding - set(live)
        assert all(result.snapshot.block_state[block] != BLOCK_USED for block in gone)
        seen_sliding |= set(live)
    assert freed_before >= (len(PROMPT) + DECODES - WINDOW) // BS - 1, "the window let go of its old blocks"
    assert results[-1].stats.group_held_blocks == (0, 0)

    frames = list(RunLogReader(tmp_path / "runs.db").iter_snapshots(logger.run_id))
    unrecorded = dict(schedule_duration=0.0, update_duration=0.0, snapshot_duration=0.0)
    assert [frame.stats for frame in frames] == [dataclasses.replace(r.stats, **unrecorded) for r in results]
    assert frames[-2].snapshot.requests[0].group_block_tables == results[-2].snapshot.requests[0].group_block_tables
    assert frames[0].snapshot.kv_cache_groups == groups
