"""Lesson: fragmentation. The same six requests under the contiguous allocator, then under paging, then longer
requests paged: KV utilisation and the one-partial-block bound, measured.

The claim (PagedAttention, section 3): reserving max_model_len for every request
up front leaves only 20-40% of KV memory holding tokens (60-80% wasted);
paging wastes at most one partly filled block per request, under 4% for
requests of a realistic length. The class sees the reserved-but-empty runs of
blocks (╌), the requests left waiting for one, the same requests all running
in a handful of blocks, and then four requests of about 200 tokens, where half
a block of waste a request comes to about 4%: shorter requests waste more,
because the one partial block is a larger share of them.
"""

from __future__ import annotations

from kvscope.app.lessons.cues import after_steps, is_running
from kvscope.app.lessons.load import ask, question, read
from kvscope.app.lessons.script import Beat, Lesson, Moment, closing, select
from kvscope.app.lessons.words import compared, percent, plural, spark
from kvscope.app.widgets.paged_vs_contiguous import compare_allocations

NUM_REQUESTS = 6
MAX_TOKENS = 8
LOOK_AT_STEP = 3
# Prompt sizes of the long requests, in tokens: about 200 each, so half a block (8 slots) is about 4% of one.
LONG_PROMPTS = (196, 203, 189, 210)
LONG_MAX_TOKENS = 8
LONG_LOOK_AT_STEP = 2


def load(ctx) -> list:
    return [ask(f"r{i + 1}", question(i), MAX_TOKENS) for i in range(NUM_REQUESTS)]


def load_long(ctx) -> list:
    return [read(f"long{i + 1}", ctx, size, LONG_MAX_TOKENS, offset=90 * i) for i, size in enumerate(LONG_PROMPTS)]


def _row(result) -> int:
    """What the contiguous allocator reserved per request: max_model_len, rounded up to whole blocks."""
    return max((v.reserved_slots for v in result.snapshot.requests), default=0)


def _paged(moment: Moment, key: str | None = None):
    """The paged figures of a step: tokens held, slots in the blocks in use, and the live requests."""
    result = moment.result if key is None else moment.earlier[key]
    return compare_allocations(result.snapshot, moment.info.runner.max_model_len), len(result.snapshot.requests)


def say_contiguous(moment: Moment) -> str:
    snapshot = moment.snapshot
    row = _row(moment.result)
    comparison = compare_allocations(snapshot, row)
    running, waiting = moment.queued("running"), moment.queued("waiting")
    return (f"The [b]contiguous[/b] allocator reserves max_model_len = {row} tokens for every request before it "
            f"writes a token: {row // snapshot.block_size} blocks in one unbroken run of the pool (on the map a run "
            f"wraps from one row of cells to the next). {plural(len(running), 'request')} hold "
            f"{comparison.num_tokens:,} tokens in {comparison.contiguous_slots:,} reserved slots: "
            f"[b]KV utilisation {percent(1 - comparison.contiguous_waste)}[/b] (tokens held ÷ slots reserved), "
            f"{percent(comparison.contiguous_waste)} empty (╌). {', '.join(waiting) or 'Nobody'} must wait: no "
            "run of free blocks is left.")


def say_waiting(moment: Moment) -> str:
    steps = moment.run_steps()
    return (f"At step {moment.stats.step} a run came free and r5 took it. Under contiguous reservation a request "
            f"waits for a whole {_row(moment.result)}-token run, however few tokens it will write. Requests in the "
            f"batch, step by step: [$accent]{spark([r.batch for r in steps])}[/] (never more than "
            f"{max(r.batch for r in steps)}).")


def say_paged(moment: Moment) -> str:
    comparison, live = _paged(moment)
    blocks = comparison.paged_slots // moment.snapshot.block_size
    empty = comparison.paged_slots - comparison.paged_tokens
    return (f"[b]Paging[/b], same requests: a request takes a block only when it fills the one before. "
            f"{plural(len(moment.queued('running')), 'request')} run at once in {blocks} blocks. The only empty "
            f"slots are in each request's last block: [b]at most one partly filled block per request[/b], under "
            f"{moment.snapshot.block_size} slots. {empty} empty slots of {comparison.paged_slots:,}: "
            f"[b]KV utilisation {percent(1 - comparison.paged_waste)}[/b], {percent(comparison.paged_waste)} empty, "
            f"above the paper's 4%: these requests hold about {comparison.paged_tokens // max(live, 1)} tokens "
            "each, and the partial block is a large share of so few.")


def say_long(moment: Moment) -> str:
    comparison, live = _paged(moment)
    short, short_live = _paged(moment, "paged")
    empty, short_empty = (comparison.paged_slots - comparison.paged_tokens,
                          short.paged_slots - short.paged_tokens)
    return (f"{plural(live, 'request')} of about {comparison.paged_tokens // live} tokens, paged. Each still has "
            f"at most one partly filled block: {empty} empty slots of {comparison.paged_slots:,}, "
            f"{empty / live:.1f} a request, {empty / live / moment.snapshot.block_size:.0%} of a block (half a block "
            f"on average, over many requests). [b]KV utilisation {percent(1 - comparison.paged_waste)}[/b], "
            f"[b]{percent(comparison.paged_waste)} empty[/b], against the paper's 4%. The short requests left "
            f"{short_empty / short_live:.1f} empty slots a request against {short.paged_tokens // short_live} tokens "
            f"({percent(short.paged_waste)}): " + (
                "[b]shorter requests waste more[/b], because the same partial block is a larger share of them."
                if compared(comparison.paged_waste, short.paged_waste, noise=0) > 0 else
                "here the shorter requests did not waste more: their partial blocks happened to be fuller."))


def say_figures(moment: Moment) -> str:
    contiguous = moment.earlier["contiguous"]
    waste_c = compare_allocations(contiguous.snapshot, _row(contiguous)).contiguous_waste
    (short, _), (long, _) = _paged(moment, "paged"), _paged(moment, "long")
    runs = (moment.run_steps(moment.earlier_runs["contiguous"]), moment.run_steps(moment.earlier_runs["paged"]))
    rows = [("", "contiguous", "paged", "long"),
            ("KV utilisation", percent(1 - waste_c), percent(1 - short.paged_waste), percent(1 - long.paged_waste)),
            ("empty", percent(waste_c), percent(short.paged_waste), percent(long.paged_waste)),
            ("most at once", *(str(max(r.batch for r in run)) for run in runs), ""),
            ("steps, all six", *(str(len(run)) for run in runs), "")]
    # Sized to the panel's CAPTION_WIDTH: a wider row wraps into nonsense at 120x40.
    table = "\n".join(f"{a:<14}{b:>11}{c:>8}{d:>7}" for a, b, c, d in rows)
    return (f"[b]The figures of this run[/b]\n{table}\n[dim]long: the longer requests, paged[/]\n\n"
            "The PagedAttention paper found 20–40% of KV memory holding "
            "tokens (60–80% wasted) in systems that reserve contiguously, and under 4% wasted with paging: one "
            "partly filled block per request at most, half a block on average.")


LESSON = Lesson(
    name="fragmentation",
    title="Fragmentation: contiguous reservation against paging",
    summary="The same requests under the contiguous allocator and under paging, then longer ones: KV utilisation "
            "and the one-partial-block bound, measured.",
    config={"allocator": "contiguous"},
    beats=(
        Beat("contiguous", "Every request reserves max_model_len", say_contiguous, until=after_steps(LOOK_AT_STEP),
             load=load, point=select("r1")),
        Beat("waiting", "Waiting for a run of blocks", say_waiting, until=is_running("r5"),
             point=select("r5")),
        Beat("paged", "The same requests, paged", say_paged, until=after_steps(LOOK_AT_STEP),
             config={"allocator": "paged"}, load=load, point=select("r1")),
        Beat("long", "Longer requests: about 4%", say_long, until=after_steps(LONG_LOOK_AT_STEP),
             config={"allocator": "paged"}, load=load_long, point=select("long1")),
        closing("What paging saved", say_figures),
    ),
)
