"""Lesson: prefix sharing. A system prompt computed once, its blocks shared, cached, and evicted LRU first.

Every full block is registered in the prefix cache under a hash of its tokens
and of every token before it. A request whose prompt starts with the same
tokens points its table at those blocks instead of computing them (the map
shows each one's ref count). When the requests finish, the blocks stay cached
(░) until the pool needs them; then the least recently used go first, and
because a finished request frees its table tail first, a prefix loses its end
before its start, so a later request can still reuse the beginning.
"""

from __future__ import annotations

from kvscope.app.lessons.cues import all_done, every, has_event, is_running, prefilled
from kvscope.app.lessons.load import ask, question, read, system_prompt
from kvscope.app.lessons.script import Beat, Highlight, Lesson, Moment, closing, select
from kvscope.app.lessons.words import figures, percent, plural
from kvscope.engine.outputs import BLOCK_CACHED, EventKind

POOL_BLOCKS = 36
SYSTEM_TOKENS = 130
SHARERS = ("r2", "r3", "r4", "r5")
MAX_TOKENS = 8
LONG = ("r6", "r7")


def _system(ctx) -> str:
    return system_prompt(ctx, SYSTEM_TOKENS)


def load_first(ctx) -> list:
    return [ask("r1", question(0), MAX_TOKENS, system=_system(ctx))]


def load_sharers(ctx) -> list:
    return [ask(name, question(i + 1), MAX_TOKENS, system=_system(ctx)) for i, name in enumerate(SHARERS)]


def load_long(ctx) -> list:
    """Two plain prompts that together leave 4 blocks of the pool: most cached blocks must go."""
    tokens = min(ctx.max_model_len - 8, (ctx.num_blocks - 4) // 2 * ctx.block_size)
    return [read(name, ctx, tokens, 4, offset=100 * i) for i, name in enumerate(LONG)]


def load_again(ctx) -> list:
    return [ask("r8", question(6), MAX_TOKENS, system=_system(ctx))]


def _hashed(moment: Moment, request_id: str) -> tuple[int, ...]:
    """The request's blocks that are registered in the prefix cache (full, hashed)."""
    return tuple(b for b in moment.table(request_id) if moment.snapshot.block_hashes[b])


def _shared(moment: Moment) -> tuple[int, ...]:
    return tuple(b for b in range(moment.snapshot.num_blocks) if moment.snapshot.ref_counts[b] > 1)


def say_first(moment: Moment) -> str:
    hashed = _hashed(moment, "r1")
    view = moment.view("r1")
    return (f"r1's prompt is {view.num_prompt_tokens} tokens and starts with a system prompt. Its "
            f"{plural(len(hashed), 'full block')} ({hashed[0]}–{hashed[-1]}) were computed and [b]registered in the "
            "prefix cache[/b] under a hash of their tokens and of every token before them. The last block is "
            "not full, so it has no hash yet.")


def say_shared(moment: Moment) -> str:
    shared = _shared(moment)
    stats = moment.stats
    refs = int(moment.snapshot.ref_counts[shared[0]]) if shared else 0
    cached = [moment.view(name).num_cached_tokens for name in SHARERS]
    return (f"r2–r5 start with the same system prompt. Each found it in the cache: their tables point at the same "
            f"{plural(len(shared), 'block')} (the ones holding nothing but the system prompt), so each of those "
            f"shows its ref count, [b]{refs}[/b]. They skipped "
            f"{sum(cached):,} prompt tokens between them; prefix hits so far: {stats.prefix_cache_hits:,} of "
            f"{stats.prefix_cache_queries:,} tokens ({percent(stats.prefix_cache_hits / stats.prefix_cache_queries)}).")


def say_cached(moment: Moment) -> str:
    cached = _cached(moment)
    return (f"Every request finished. Their blocks are free, but {plural(len(cached), 'block')} keep their hash: "
            "[b]cached[/b] (░), ref count 0, ready for the next request with the same prefix. They count as free: "
            f"free blocks {moment.stats.num_free_blocks} of {moment.stats.num_total_blocks}.")


def _cached(moment: Moment) -> tuple[int, ...]:
    return tuple(b for b in range(moment.snapshot.num_blocks) if moment.snapshot.block_state[b] == BLOCK_CACHED)


def _evicted(moment: Moment) -> tuple[int, ...]:
    return tuple(b for e in moment.result.events if e.kind == EventKind.EVICT for b in e.blocks)


def say_evicted(moment: Moment) -> str:
    evicted = _evicted(moment)
    prefix = _shared_at(moment, "shared")
    survivors = [b for b in prefix if b not in evicted]
    kept = (f"its first {plural(len(survivors), 'block')} ({', '.join(map(str, survivors))}) survive"
            if survivors else "none of its blocks survive")
    return (f"r6 and r7 need more blocks than were plainly free, so {plural(len(evicted), 'cached block')} were "
            f"[b]evicted[/b], least recently used first: {', '.join(map(str, evicted))}. A request frees its table "
            f"tail first, so the system prompt loses its end before its start: {kept}.")


def _shared_at(moment: Moment, key: str) -> tuple[int, ...]:
    snapshot = moment.earlier[key].snapshot
    return tuple(b for b in range(snapshot.num_blocks) if snapshot.ref_counts[b] > 1)


def say_again(moment: Moment) -> str:
    view = moment.view("r8")
    return (f"r8 starts with the same system prompt. It found {view.num_cached_tokens} of its "
            f"{view.num_prompt_tokens} prompt tokens in the cache (the blocks that survived) and computed the rest: "
            "a shorter prefix, still reused.")


def say_figures(moment: Moment) -> str:
    stats = moment.stats
    steps = moment.run_steps()
    evicted = sum(len(e.blocks) for record in steps for e in record.events if e.kind == EventKind.EVICT)
    computed = sum(record.stats.num_prefill_tokens for record in steps)
    hits = f"{stats.prefix_cache_hits:,} ({percent(stats.prefix_cache_hits / stats.prefix_cache_queries)})"
    return figures([("prompt tokens asked", f"{stats.prefix_cache_queries:,}"), ("found in the cache", hits),
                    ("prompt tokens computed", f"{computed:,}"), ("blocks evicted", str(evicted)),
                    ("steps", str(len(steps)))],
                   "Without the prefix cache, every request would have computed its whole prompt.")


LESSON = Lesson(
    name="prefix-sharing",
    title="Prefix sharing: compute a system prompt once",
    summary="A shared system prompt: computed once, ref counts rising, cached when free, evicted LRU first.",
    config={"num_blocks": POOL_BLOCKS, "enable_prefix_caching": True},
    beats=(
        Beat("first", "The first request computes the prefix", say_first, until=prefilled("r1"), load=load_first,
             point=lambda m: Highlight("r1", _hashed(m, "r1"))),
        Beat("shared", "Four more requests share it", say_shared, load=load_sharers,
             until=every(*(is_running(name) for name in SHARERS)), point=lambda m: Highlight("r3", _shared(m))),
        Beat("cached", "Free, but still cached", say_cached, until=all_done,
             point=lambda m: Highlight(blocks=_cached(m))),
        Beat("evicted", "The pool needs room: LRU eviction", say_evicted, until=has_event(EventKind.EVICT),
             load=load_long, point=lambda m: Highlight(blocks=_evicted(m))),
        Beat("again", "What a later request still finds", say_again, until=is_running("r8"), load=load_again,
             point=select("r8")),
        closing("What sharing saved", say_figures),
    ),
)
