"""Lesson: sliding window. A request's sliding-window blocks leave the window as it advances, and what a hybrid
KV cache saves against keeping every layer's K/V for every token.

Gemma 3 270M's layers are five of 512-token windows per full one. The engine
groups them by attention kind into KV-cache groups sharing one pool, each
sequence with one block table per group (engine/kv_cache_groups.py). One long
prompt, computed in chunks so the window is crossed a few steps in: the full
group's table grows with every chunk, while each sliding group gives back the
blocks no query can see any more and stays at the window's blocks. Everything
the lesson says is read from the engine it runs on (its groups, window, block
size, chunk and pool), so a test can play it on a tiny model with a short
window. The allocator is paged whatever the app's is (the contiguous one keeps
every layer in one group), and prefix caching is off, so a block the window
frees is plainly free.
"""

from __future__ import annotations

from kvscope.app.lessons.cues import prefilled
from kvscope.app.lessons.load import read
from kvscope.app.lessons.script import Beat, Highlight, Lesson, Moment, closing, select
from kvscope.app.lessons.words import figures, percent, plural
from kvscope.engine.kv_cache_groups import KVCacheGroup, blocks_per_sequence, max_concurrency
from kvscope.engine.outputs import NULL_BLOCK, CacheSnapshot, StepResult

MODEL = "gemma3-270m"
REQUEST = "r1"
MAX_TOKENS = 4
CHUNKS_PAST_THE_WINDOW = 3      # the prompt runs this many chunks past the window: blocks leave at each


def _window(groups: tuple[KVCacheGroup, ...]) -> int:
    """The shortest sliding window among the engine's groups."""
    return min(g.sliding_window for g in groups if g.sliding_window is not None)


def load(ctx) -> list:
    prompt = min(_window(ctx.kv_cache_groups) + CHUNKS_PAST_THE_WINDOW * ctx.max_num_batched_tokens,
                 ctx.max_model_len - MAX_TOKENS)
    return [read(REQUEST, ctx, prompt, MAX_TOKENS)]


def _tables(snapshot: CacheSnapshot) -> tuple[tuple[int, ...], ...]:
    """The request's table in each group (sample 0); () once it has left the engine."""
    view = next((v for v in snapshot.requests if v.request_id == REQUEST), None)
    return view.group_block_tables[0] if view is not None and view.group_block_tables else ()


def _held(table) -> int:
    return sum(1 for block in table if block != NULL_BLOCK)


def window_full(result: StepResult) -> bool:
    """The request has computed a whole window's tokens."""
    return any(v.request_id == REQUEST and v.num_computed_tokens >= _window(result.snapshot.kv_cache_groups)
               for v in result.snapshot.requests)


def left_window(result: StepResult) -> bool:
    """A sliding group of the request has given a block back."""
    return any(NULL_BLOCK in table for table in _tables(result.snapshot))


def _kinds(snapshot: CacheSnapshot) -> tuple[list[int], list[int]]:
    """The indices of the full groups and of the sliding ones."""
    groups = snapshot.kv_cache_groups
    return ([i for i, g in enumerate(groups) if g.sliding_window is None],
            [i for i, g in enumerate(groups) if g.sliding_window is not None])


def _left(moment: Moment) -> tuple[int, ...]:
    """The blocks the sliding groups gave back, as the tables held them when the window was full."""
    before = _tables(moment.earlier["window"].snapshot)
    return tuple(before[g][i] for g, table in enumerate(_tables(moment.snapshot))
                 for i, block in enumerate(table) if block == NULL_BLOCK and i < len(before[g]))


def _layers(snapshot: CacheSnapshot) -> str:
    groups = snapshot.kv_cache_groups
    count = sum(len(g.layers) for g in groups)
    sliding = sum(len(groups[g].layers) for g in _kinds(snapshot)[1])
    return (f"{count} layers: {sliding} see only the last {_window(groups)} positions (a [b]sliding window[/b]), "
            f"{count - sliding} see all")


def say_window(moment: Moment) -> str:
    snapshot, view = moment.snapshot, moment.view(REQUEST)
    groups = snapshot.kv_cache_groups
    full, sliding = _kinds(snapshot)
    return (f"{moment.info.runner.model_name} has {_layers(snapshot)}. As in vLLM's hybrid KV cache they form "
            f"[b]{plural(len(groups), 'KV-cache group')}[/b] of {plural(len(groups[0].layers), 'layer')} "
            f"({len(full)} full, {len(sliding)} sliding) in one pool: {REQUEST} has [b]a block table per group[/b], "
            f"a block holding {snapshot.block_size} tokens of one group's layers. Its {view.num_prompt_tokens}-token "
            f"prompt runs {moment.info.config.max_num_batched_tokens} tokens a step; after "
            f"{plural(len(moment.run_steps()), 'step')} the window is full ({view.num_computed_tokens} tokens) and "
            f"all {len(groups)} tables hold the same {plural(len(_tables(snapshot)[0]), 'block')}.")


def say_left(moment: Moment) -> str:
    snapshot, view = moment.snapshot, moment.view(REQUEST)
    full, sliding = _kinds(snapshot)
    tables = _tables(snapshot)
    gone = sum(1 for block in tables[sliding[0]] if block == NULL_BLOCK)
    start = view.num_computed_tokens - moment.stats.num_prefill_tokens
    return (f"The chunk starting at position {start} sees back only to {start - _window(snapshot.kv_cache_groups) + 1}"
            f". The first {plural(gone, 'block')} of each sliding table hold positions before that: they [b]left "
            f"the window[/b]. {len(sliding)} × {gone} = {plural(len(sliding) * gone, 'block')} (marked) went back "
            "to the free queue's front, and this step's new blocks came from there. The full table keeps all "
            f"{len(tables[full[0]])}; each sliding table holds {_held(tables[sliding[0]])} of its "
            f"{len(tables[sliding[0]])} entries.")


def _bound(snapshot: CacheSnapshot, chunk: int) -> int:
    """The most blocks one sliding group of the request holds at once: the window's, plus the step's chunk,
    plus one for a window that straddles a block boundary (the engine's own rule)."""
    window = _window(snapshot.kv_cache_groups)
    return blocks_per_sequence((KVCacheGroup((0,), window),), 10**9, snapshot.block_size, chunk)


def _saving(snapshot: CacheSnapshot) -> tuple[int, int]:
    """(blocks the request holds, blocks it would hold with every layer kept full): every group's table is as
    long as the full group's, a freed entry counting as a block kept."""
    tables = _tables(snapshot)
    return sum(_held(t) for t in tables), sum(len(t) for t in tables)


def say_advanced(moment: Moment) -> str:
    snapshot, info = moment.snapshot, moment.info
    full, sliding = _kinds(snapshot)
    tables = _tables(snapshot)
    chunk = info.config.max_num_batched_tokens
    held, kept_full = _saving(snapshot)
    pool = info.runner.num_device_blocks
    return (f"{REQUEST}'s prompt is in. The full table grew to [b]{len(tables[full[0]])} blocks[/b], marked; each "
            f"sliding one holds {_held(tables[sliding[0]])}, however long the prompt: at most "
            f"{_bound(snapshot, chunk)} while a {chunk}-token chunk runs, {_bound(snapshot, 1)} = ceil(W/B) + 1 "
            f"while it decodes. {REQUEST} holds [b]{plural(held, 'block')}[/b]; with every layer kept full, "
            f"{len(tables)} × {len(tables[full[0]])} = {kept_full}" +
            (f": more than this {pool}-block pool." if kept_full > pool else "."))


def _all_full(groups: tuple[KVCacheGroup, ...]) -> tuple[KVCacheGroup, ...]:
    return tuple(KVCacheGroup(g.layers) for g in groups)


def say_figures(moment: Moment) -> str:
    advanced = moment.earlier["advanced"].snapshot
    runner, chunk = moment.info.runner, moment.info.config.max_num_batched_tokens
    groups, length = advanced.kv_cache_groups, runner.max_model_len
    held, kept_full = _saving(advanced)
    freed = kept_full - held

    def concurrency(kinds) -> str:
        return f"{max_concurrency(kinds, runner.num_device_blocks, runner.block_size, length, chunk):.2f}x"

    return figures([(f"blocks {REQUEST} held, hybrid", str(held)), ("every layer kept full", str(kept_full)),
                    ("given back by the window", f"{freed} ({percent(freed / kept_full)})"),
                    ("concurrency, hybrid", concurrency(groups)),
                    ("concurrency, kept full", concurrency(_all_full(groups)))],
                   f"Concurrency: requests of {length:,} tokens (max_model_len) the {runner.num_device_blocks}-block "
                   "pool holds at once, counted as vLLM's \"Maximum concurrency\" line. A sliding layer never reads "
                   "behind its window, so only the full layers keep every token.")


LESSON = Lesson(
    name="sliding-window",
    title="Sliding window: blocks that leave, memory a hybrid cache saves",
    summary="Gemma 3's sliding-window layers give their blocks back as a request advances; the full layers keep "
            "theirs. Blocks held against every layer kept full, measured.",
    config={"model": MODEL, "allocator": "paged", "block_size": 64, "num_blocks": 80, "max_model_len": 1024,
            "max_num_batched_tokens": 128, "enable_prefix_caching": False},
    beats=(
        Beat("window", "One block table per KV-cache group", say_window, until=window_full, load=load,
             point=select(REQUEST)),
        Beat("left", "Blocks leave the window", say_left, until=left_window,
             point=lambda m: Highlight(REQUEST, _left(m))),
        Beat("advanced", "The full table grows, the window does not", say_advanced, until=prefilled(REQUEST),
             point=lambda m: Highlight(REQUEST, _tables(m.snapshot)[_kinds(m.snapshot)[0][0]])),
        closing("What the hybrid cache saved", say_figures),
    ),
)
