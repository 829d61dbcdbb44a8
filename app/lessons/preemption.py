"""Lesson: preemption. More demand than blocks: the latest arrival is pushed out, recomputed, then swapped.

Four requests start in a 7-block pool; each will need 2 blocks, 8 in all.
When they all cross into their second block at the same step, the scheduler
preempts the request that arrived last. In recompute mode its blocks are simply
freed and it waits to compute its tokens again; in swap mode (the second run,
same requests) its blocks are copied to the host pool and back, and nothing is
recomputed. Prefix caching is off here, so a recomputed request computes every
one of its tokens again (with it on, its own full blocks could come back from
the cache).
"""

from __future__ import annotations

from kvscope.app.lessons.cues import all_done, has_event
from kvscope.app.lessons.load import read
from kvscope.app.lessons.script import Beat, Highlight, Lesson, Moment, closing, select
from kvscope.app.lessons.words import arrows
from kvscope.engine.outputs import EventKind

POOL_BLOCKS = 7
NAMES = ("r1", "r2", "r3", "r4")
PROMPT_TOKENS = 12
MAX_TOKENS = 10
VICTIM = "r4"


def load(ctx) -> list:
    return [read(name, ctx, PROMPT_TOKENS, MAX_TOKENS, offset=50 * i) for i, name in enumerate(NAMES)]


def _event(moment: Moment, kind: EventKind):
    return next(e for e in moment.result.events if e.kind == kind)


def _pointing_at(kind: EventKind, with_blocks: bool = True):
    """Highlight the request of the step's first ``kind`` event, and that event's blocks."""
    def point(moment: Moment) -> Highlight:
        event = _event(moment, kind)
        return Highlight(event.request_id, event.blocks) if with_blocks else Highlight(event.request_id)
    return point


def back_from_recompute(result) -> bool:
    """The victim ran again: its tokens were computed anew and it produced a token (it may even be done)."""
    return any(o.request_id == VICTIM and o.new_token_ids for o in result.outputs)


def which_blocks(blocks) -> str:
    """"block 3" or "2 blocks (3, 4)": a block's number never read as a count."""
    return f"block {blocks[0]}" if len(blocks) == 1 else f"{len(blocks)} blocks ({', '.join(map(str, blocks))})"


def say_preempt(moment: Moment) -> str:
    event = _event(moment, EventKind.PREEMPT)
    view = moment.view(event.request_id)
    tokens = view.num_prompt_tokens + view.num_output_tokens
    return (f"The pool is out of blocks: every request needed a new one in the same step. The scheduler "
            f"[b]preempted {event.request_id}[/b], the latest arrival: its {which_blocks(event.blocks)} went back "
            "to the pool for the others to take. In "
            f"[b]recompute[/b] mode {event.request_id} returns to the front of the waiting queue; its {tokens} "
            "tokens (prompt and output so far) will be computed again.")


def say_back(moment: Moment) -> str:
    view = moment.view(VICTIM)
    prefill = moment.stats.num_prefill_tokens
    where = f"its table is now {arrows(view.block_tables[0])}" if view is not None else "it is even done"
    return (f"Blocks came free and {VICTIM} ran again: it recomputed {prefill} tokens in one prefill step, "
            f"and {where}. That prefill is the price of recompute.")


def say_done(moment: Moment) -> str:
    steps = moment.run_steps()
    prefill = sum(r.stats.num_prefill_tokens for r in steps)
    prompts = sum(v.num_prompt_tokens for v in moment.earlier["preempt"].snapshot.requests)
    return (f"All four finished after [b]{len(steps)} steps[/b]. They computed {prefill} prompt tokens for four "
            f"prompts of {prompts} tokens in all: the {prefill - prompts} more are what {VICTIM} computed twice "
            "(its prompt and the output it had). Next: the same requests in swap mode.")


def say_swapped(moment: Moment) -> str:
    event = _event(moment, EventKind.SWAP_OUT)
    view = moment.view(event.request_id)
    host = view.host_block_tables[0] if view.host_block_tables else ()
    return (f"[b]Swap[/b] mode, same requests, same moment: this time {event.request_id}'s "
            f"{which_blocks(event.blocks)} {'was' if len(event.blocks) == 1 else 'were'} copied to the host pool "
            f"(the line under the map: host {which_blocks(host)}) instead of being thrown away. "
            f"{event.request_id} waits in the [b]swapped[/b] queue.")


def swapped_in_this_step(moment: Moment) -> int:
    """How many blocks were copied back from the host pool in the moment's step (the stats count them all)."""
    steps = moment.run_steps()
    before = steps[-2].stats.num_swapped_in_blocks if len(steps) > 1 else 0
    return moment.stats.num_swapped_in_blocks - before


def say_swapped_in(moment: Moment) -> str:
    """The swap-in event lists the request's whole device table, which may hold a block just allocated for
    its next token besides the copied ones: the count comes from the blocks actually copied."""
    event = _event(moment, EventKind.SWAP_IN)
    copied = swapped_in_this_step(moment)
    fresh = len(event.blocks) - copied
    new = f", and {which_blocks(event.blocks[copied:])} new for the tokens it writes next" if fresh > 0 else ""
    return (f"Blocks are free again: {event.request_id}'s {copied} swapped "
            f"{'block was' if copied == 1 else 'blocks were'} copied back from the host pool into device "
            f"{which_blocks(event.blocks[:copied])}{new}: its table is now [b]{arrows(event.blocks)}[/b]. It goes "
            "on from where it stopped: nothing recomputed.")


def say_figures(moment: Moment) -> str:
    recompute, swap = moment.run_steps(moment.run - 1), moment.run_steps()

    def prefilled(run) -> int:
        return sum(r.stats.num_prefill_tokens for r in run)

    rows = [("mode", "recompute", "swap"),
            ("preemptions", str(recompute[-1].stats.num_preemptions), str(swap[-1].stats.num_preemptions)),
            ("prefill tokens", str(prefilled(recompute)), str(prefilled(swap))),
            ("swapped out/in", "0/0",
             f"{swap[-1].stats.num_swapped_out_blocks}/{swap[-1].stats.num_swapped_in_blocks}"),
            ("steps", str(len(recompute)), str(len(swap)))]
    table = "\n".join(f"{a:<15}{b:>10}{c:>7}" for a, b, c in rows)
    extra = prefilled(recompute) - prefilled(swap)
    cost = (f"Recompute cost {extra} more prefill tokens than swap here (the victim's tokens, computed twice)"
            if extra > 0 else "Recompute computed no more than swap here (the victim had little to redo)")
    return (f"[b]The figures of this run[/b]\n{table}\n\n{cost}; swap costs host memory and copy bandwidth "
            "instead. vLLM V1 recomputes: on a GPU, prefill is fast.")


LESSON = Lesson(
    name="preemption",
    title="Preemption: recompute, then swap",
    summary="More requests than fit: the latest arrival is preempted, recomputed, then swapped out and back.",
    config={"num_blocks": POOL_BLOCKS, "preemption_mode": "recompute", "enable_prefix_caching": False},
    beats=(
        Beat("preempt", "Out of blocks: the latest arrival goes", say_preempt, until=has_event(EventKind.PREEMPT),
             load=load, point=_pointing_at(EventKind.PREEMPT)),
        Beat("back", "Back, and computed again", say_back, until=back_from_recompute,
             point=select(VICTIM)),
        Beat("recompute-done", "Recompute mode: all done", say_done, until=all_done),
        Beat("swapped", "Swap mode: out to the host pool", say_swapped, until=has_event(EventKind.SWAP_OUT),
             config={"num_blocks": POOL_BLOCKS, "preemption_mode": "swap"}, load=load,
             point=_pointing_at(EventKind.SWAP_OUT, with_blocks=False)),
        Beat("swapped-in", "And back in", say_swapped_in, until=has_event(EventKind.SWAP_IN),
             point=_pointing_at(EventKind.SWAP_IN)),
        closing("Recompute against swap", say_figures),
    ),
)
