"""The panels' arithmetic on hand-made snapshots: map cells, block details, paged vs contiguous, presets."""

from __future__ import annotations

import numpy as np
import pytest
from app_harness import replace
from textual.content import Content

from kvscope.app.load.presets import PRESETS, PresetContext, build
from kvscope.app.widgets import block_cells as cells
from kvscope.app.widgets.block_inspector import describe_block, describe_cell
from kvscope.app.widgets.block_legend import GAP, ITEMS, legend_lines
from kvscope.app.widgets.map_aggregates import owners_recounted
from kvscope.app.widgets.paged_vs_contiguous import compare_allocations
from kvscope.app.widgets.throughput import bar_levels
from kvscope.engine.config import RequestError
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.outputs import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED, CacheSnapshot, RequestView


def view(request_id: str, arrival: int, *tables: tuple[int, ...], queue: str = "running", used: int = 0) -> RequestView:
    return RequestView(request_id=request_id, queue=queue, arrival_index=arrival, block_tables=tables,
                       host_block_tables=(), num_prompt_tokens=20, num_output_tokens=5, max_tokens=64,
                       num_computed_tokens=25, num_cached_tokens=0, num_preemptions=0,
                       num_samples=len(tables),
                       reserved_slots=0, used_slots=used)


def snapshot(num_blocks: int = 8, block_size: int = 4, allocator: str = "paged", kv_cache_groups=()) -> CacheSnapshot:
    """Blocks 0-1: r0's full blocks, 1 shared with r1; 2: r0's half-full last block; 3: r1's last (1/4);
    4: cached free; the rest free. Each view's used_slots is what its table's blocks hold, as the engine's are."""
    state = np.full(num_blocks, BLOCK_FREE, dtype=np.int8)
    state[[0, 1, 2, 3]] = BLOCK_USED
    state[4] = BLOCK_CACHED
    refs = np.zeros(num_blocks, dtype=np.int32)
    refs[[0, 2, 3]] = 1
    refs[1] = 2
    fill = np.zeros(num_blocks, dtype=np.int16)
    fill[[0, 1, 4]] = block_size
    fill[2], fill[3] = 2, 1
    hashes = np.zeros(num_blocks, dtype=np.uint64)
    hashes[[0, 1, 4]] = [11, 22, 44]
    return CacheSnapshot(step=7, block_size=block_size, num_blocks=num_blocks, allocator=allocator,
                         block_state=state, ref_counts=refs, block_fill=fill, block_hashes=hashes,
                         requests=(view("r0", 0, (0, 1, 2), used=4 + 4 + 2), view("r1", 1, (1, 3), used=4 + 1)),
                         kv_cache_groups=kv_cache_groups)


def glyphs(codes: np.ndarray) -> str:
    return "".join(cells.GLYPHS[cells.decode(code)[2]] for code in codes)


def test_layout_prefers_wide_cells_and_aggregates_only_when_it_must():
    assert cells.fit_layout(100, 80, 10) == cells.MapLayout(100, 20, 4, 1)
    assert cells.fit_layout(600, 80, 10) == cells.MapLayout(600, 80, 1, 1)
    big = cells.fit_layout(4096, 80, 10)
    assert (big.cell_width, big.blocks_per_cell) == (1, 6) and big.num_cells * 6 >= 4096
    assert big.cell_at(3, 2) == 163 and big.blocks_of(163) == range(978, 984)
    assert big.cell_at(80, 0) is None


def test_cell_codes_show_state_fill_sharing_and_owner():
    snap = snapshot()
    codes = cells.cell_codes(snap, cells.fit_layout(8, 8, 1))
    assert glyphs(codes) == "█2▄▂░···"   # 2/4 and 1/4 filled: four and two eighths
    bases = [cells.decode(c)[0] for c in codes]
    assert bases[0] == cells.STYLE_OWNER + 0 and bases[2] == cells.STYLE_OWNER + 0
    assert bases[1] == cells.STYLE_SHARED + 0     # shared: first owner's colour
    assert bases[3] == cells.STYLE_OWNER + 1
    assert bases[4] == cells.STYLE_CACHED and bases[5] == cells.STYLE_FREE


def test_chat_and_cursor_overlays():
    snap = snapshot()
    layout = cells.fit_layout(8, 8, 1)
    codes = cells.cell_codes(snap, layout, chat="r0", cursor=5)
    overlays = [cells.decode(c)[1] for c in codes]
    assert overlays == [cells.OVERLAY_CHAT, cells.OVERLAY_CHAT, cells.OVERLAY_CHAT, 0, 0,
                        cells.OVERLAY_CURSOR, 0, 0]
    assert glyphs(codes)[0] == cells.HIGHLIGHTED_FULL_GLYPH   # a full block lets the chat tint show
    assert cells.request_blocks(snap, "gone") is None


def test_a_selection_dims_every_other_block_in_use_or_cached():
    snap = snapshot()
    layout = cells.fit_layout(8, 8, 1)
    codes = cells.cell_codes(snap, layout, selected="r1", chat="r0", cursor=5)
    overlays = [cells.decode(c)[1] for c in codes]
    dimmed, selected = cells.OVERLAY_DIMMED, cells.OVERLAY_SELECTED
    assert overlays == [dimmed, selected, dimmed, selected, dimmed, cells.OVERLAY_CURSOR, 0, 0]
    assert glyphs(codes)[:4] == "█2▄▂"   # the selected request's blocks keep their usual glyphs


def test_a_block_held_but_not_yet_written_shows_as_reserved():
    snap = snapshot()
    fill = snap.block_fill.copy()
    fill[3] = 0          # r1's last block: allocated, nothing written (as the contiguous allocator reserves)
    codes = cells.cell_codes(replace(snap, block_fill=fill), cells.fit_layout(8, 8, 1))
    assert glyphs(codes)[3] == cells.RESERVED_GLYPH


def test_aggregated_cells_count_blocks_in_use():
    snap = snapshot()
    layout = cells.MapLayout(8, 4, 1, 2)
    codes = cells.cell_codes(snap, layout)
    assert glyphs(codes) == "██░·"
    assert cells.decode(codes[0])[0] == cells.STYLE_SHARED + 0


def test_a_block_belongs_to_its_earliest_arriving_holder_whatever_the_queue_order():
    snap = snapshot()
    later_first = replace(snap, requests=tuple(reversed(snap.requests)))   # r1 (arrival 1) listed first
    assert owners_recounted(later_first).tolist() == [0, 0, 0, 1, -1, -1, -1, -1]
    assert cells.decode(cells.cell_codes(later_first, cells.fit_layout(8, 8, 1))[1])[0] == cells.STYLE_SHARED + 0


def test_block_details_name_owners_and_logical_indices():
    snap = snapshot()
    shared = describe_block(snap, 1).plain
    assert "Block 1" in shared and "ref 2" in shared and "4/4 slots" in shared and f"{22:016x}" in shared
    assert "r0 logical 1" in shared and "r1 logical 0" in shared
    assert "cached prefix, free" in describe_block(snap, 4).plain
    assert "Blocks 0–3 (one cell): 4 in use, 0 cached, 0 free" in describe_cell(snap, 0, 3).plain


def test_block_details_say_how_many_owners_did_not_fit():
    snap = snapshot()
    everyone = describe_block(snap, 1).plain
    assert "r0 logical 1, r1 logical 0" in everyone
    narrow = describe_block(snap, 1, width=24).plain.splitlines()[1]
    assert narrow == "r0 logical 1, +1 more"
    assert describe_cell(snap, 1, 3, width=44).plain.endswith("): r0 logical 1, +1 more")


def test_legend_lines_break_only_between_items():
    widest = max(Content.from_markup(item).cell_length for item in ITEMS)
    for width in (widest, 60, 90, 120, 200):
        lines = legend_lines(width)
        assert GAP.join(lines) == GAP.join(ITEMS)      # every item, whole and in order
        assert all(Content.from_markup(line).cell_length <= width for line in lines)
    assert len(legend_lines(10_000)) == 1


def test_sparkline_bars_scale_from_zero_and_keep_spikes():
    assert bar_levels([], 10) == ()
    assert bar_levels([0.0, 0.0], 10) == (0, 0)
    assert bar_levels([1.0, 2.0, 4.0], 10) == (2, 4, 7)       # fewer steps than columns: one each
    wide = bar_levels([1.0] * 19 + [8.0], 10)                  # two steps a column, newest on the right
    assert len(wide) == 10 and wide[-1] == 7 and set(wide[:-1]) == {1}


def test_paged_vs_contiguous_arithmetic():
    snap = snapshot()
    cmp = compare_allocations(snap, max_model_len=10)   # 10 tokens -> 3 blocks of 4 per sequence
    assert cmp.num_sequences == 2
    assert cmp.num_tokens == (4 + 4 + 2) + (4 + 1)
    assert cmp.contiguous_slots == 2 * 12
    assert cmp.paged_slots == 4 * 4 and cmp.paged_tokens == 4 + 4 + 2 + 1
    assert cmp.contiguous_waste == pytest.approx(1 - 15 / 24)
    assert cmp.paged_waste == pytest.approx(1 - 11 / 16)


def test_paged_vs_contiguous_counts_slots_per_group_on_a_hybrid_pool():
    """A block holds one KV-cache group's layers: a contiguous allocator would reserve max_model_len in every
    group. Counting every group's blocks as one sequence's tokens read "-287.5% empty" on the sliding-window
    lesson."""
    from kvscope.app.widgets.paged_vs_contiguous import describe_comparison
    from kvscope.engine.kv_cache_groups import group_layers

    snap = snapshot(kv_cache_groups=group_layers([8, None]))
    cmp = compare_allocations(snap, max_model_len=10)
    assert cmp.num_groups == 2 and cmp.contiguous_slots == 2 * 2 * 12
    assert cmp.num_tokens == (4 + 4 + 2) + (4 + 1) and 0 <= cmp.contiguous_waste < 1
    lines = describe_comparison(cmp, "paged", 4).splitlines()
    assert lines[0] == "2 sequences hold 15 slots" and lines[2].startswith("  2×2×12 · ")


def test_paged_vs_contiguous_when_the_engine_is_contiguous():
    cmp = compare_allocations(snapshot(allocator="contiguous"), max_model_len=10)
    assert cmp.paged_slots == 3 * 4 + 2 * 4      # each sequence's filled blocks only
    assert cmp.paged_tokens == cmp.num_tokens


@pytest.mark.parametrize("key", list(PRESETS))
def test_every_preset_is_accepted_by_an_engine(key):
    from kvscope.engine.config import EngineConfig

    config = EngineConfig(num_blocks=256, max_model_len=1024, max_num_batched_tokens=256)
    engine = fake_engine(config)
    context = PresetContext.from_engine(engine)
    planned = build(key, PRESETS[key].default_count, context)
    assert len(planned) == PRESETS[key].default_count
    for i, item in enumerate(planned):
        try:
            engine.add_request(item.prompt, item.params, request_id=f"{key}-{i}")
        except RequestError as exc:
            pytest.fail(f"{key}: {exc}")
    if key == "long":
        assert all(len(engine.prompt_token_ids(p.prompt)) > 256 for p in planned)
    if key == "overload":
        demand = sum(len(engine.prompt_token_ids(p.prompt)) + p.params.max_tokens for p in planned)
        assert demand > 1.3 * 256 * 16
    if key == "shared":
        assert planned[0].delay_steps == 0 and all(p.delay_steps > 0 for p in planned[1:])
    if key == "sample":
        assert all(p.params.n == 4 for p in planned)


def test_preset_rejects_bad_input():
    context = PresetContext(16, 64, 256, 128, len)
    with pytest.raises(ValueError):
        build("nope", 3, context)
    with pytest.raises(ValueError):
        build("burst", 0, context)


def test_system_sampler_reads_the_machine_and_says_quietly_when_there_is_no_gpu():
    from kvscope.app.widgets.system import SystemSampler, describe_sample

    sample = SystemSampler().sample()
    assert sample.ram_total > sample.ram_used > 0 and sample.process_rss > 0
    text = describe_sample(sample)
    if sample.gpus:
        assert "GPU" in text and sample.gpu_note is None
    else:
        assert sample.gpu_note and "no NVIDIA GPU" in text and "error" not in text.lower()


def test_the_kv_use_sparkline_is_a_share_of_the_pool_not_of_its_own_peak():
    """Issue 25 defect 13: 0.17% of the KV cache drew a full-height bar."""
    assert bar_levels([0.17, 0.17], 10, ceiling=100.0) == (0, 0)
    assert bar_levels([50.0, 100.0], 10, ceiling=100.0) == (4, 7)
    assert bar_levels([0.17, 0.17], 10) == (7, 7)        # a rate still scales to its window's peak


def test_a_counter_and_its_word_wrap_together():
    """Issue 25 defect 10: Counters wrapped "(194" / "cached)"."""
    from textual.content import Content

    from kvscope.app.widgets.counters import describe_stats
    from kvscope.app.widgets.snapshot_view import empty_step

    _, stats = empty_step(5825, 16, "paged")
    text = Content.from_markup(describe_stats(replace(stats, num_cached_free_blocks=194)))
    lines = [line.plain for line in text.wrap(30)]
    assert any(line.startswith("(194") and "cached)" in line for line in lines), lines
