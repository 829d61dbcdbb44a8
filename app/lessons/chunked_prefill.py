"""Lesson: chunked prefill. A long prompt split across steps under the token budget, decodes running beside it.

A step may process at most max_num_batched_tokens tokens (32 here). Two short
requests are decoding, one token each per step, when a 200-token prompt
arrives. The scheduler gives the decodes their tokens first and the prompt what
is left of the budget: the prompt is computed in chunks over several steps, and
the decodes never stall behind it.
"""

from __future__ import annotations

from kvscope.app.lessons.cues import after_steps, prefilled
from kvscope.app.lessons.load import read
from kvscope.app.lessons.script import Beat, Lesson, Moment, closing, select
from kvscope.app.lessons.words import figures, plural

BUDGET = 32
LONG = "r3"
LONG_TOKENS = 200
DECODERS = ("r1", "r2")


def load(ctx) -> list:
    short = [read(name, ctx, 12, 24, offset=30 * i) for i, name in enumerate(DECODERS)]
    return [*short, read(LONG, ctx, LONG_TOKENS, 4, delay=2, offset=200)]


def chunk_started(result) -> bool:
    return any(v.request_id == LONG and v.queue == "running" and v.num_computed_tokens > 0
               for v in result.snapshot.requests)


def _chunk_steps(moment: Moment) -> list:
    """The steps that computed part of the long prompt: from its first chunk to the step it finished."""
    steps = moment.run_steps()
    first = next(i for i, r in enumerate(steps) if r.stats.step == moment.earlier["chunk"].stats.step)
    return list(steps[first:])


def say_decoding(moment: Moment) -> str:
    stats = moment.stats
    return (f"r1 and r2 are decoding: each step computes one token for each, {stats.num_decode_tokens} tokens of "
            f"the step's budget of [b]{BUDGET}[/b] (max_num_batched_tokens).")


def say_chunk(moment: Moment) -> str:
    stats, view = moment.stats, moment.view(LONG)
    return (f"{LONG}'s prompt is {view.num_prompt_tokens} tokens, more than one step may process. This step ran "
            f"{plural(stats.num_decode_tokens, 'decode')} (r1, r2) and a [b]{stats.num_prefill_tokens}-token chunk"
            f"[/b] of {LONG}: {stats.num_decode_tokens + stats.num_prefill_tokens} tokens, the whole budget. "
            f"{LONG} has {view.num_computed_tokens} of {view.num_prompt_tokens} prompt tokens computed; its blocks "
            "fill as the chunks land.")


def say_prefilled(moment: Moment) -> str:
    steps = _chunk_steps(moment)
    view = moment.view(LONG)
    decodes = sum(r.stats.num_decode_tokens for r in steps)
    blocks = len(view.block_tables[0])
    return (f"After {plural(len(steps), 'step')} {LONG}'s whole prompt is in the cache ({plural(blocks, 'block')}) "
            f"and it produced its first token. Meanwhile r1 and r2 kept decoding: {decodes} tokens between them. "
            f"Without chunking, one {view.num_prompt_tokens}-token step would have held them up.")


def say_figures(moment: Moment) -> str:
    steps = moment.run_steps()
    sizes = [r.stats.num_prefill_tokens + r.stats.num_decode_tokens for r in steps]
    chunks = [r.stats.num_prefill_tokens for r in _chunk_steps(moment) if r.stats.num_prefill_tokens]
    return figures([("budget per step", f"{BUDGET} tokens"), ("largest step", f"{max(sizes)} tokens"),
                    (f"{LONG}'s chunks", " + ".join(map(str, chunks))), ("steps", str(len(steps)))],
                   "Chunked prefill bounds every step's work, so the time between two tokens of a decoding "
                   "request stays short even while long prompts arrive.")


LESSON = Lesson(
    name="chunked-prefill",
    title="Chunked prefill: long prompts under a token budget",
    summary="A long prompt split across steps under the token budget, with decodes running in the same steps.",
    config={"max_num_batched_tokens": BUDGET},
    beats=(
        Beat("decoding", "Two requests decoding", say_decoding, until=after_steps(2), load=load,
             point=select("r1")),
        Beat("chunk", "A long prompt arrives", say_chunk, until=chunk_started, point=select(LONG)),
        Beat("prefilled", "The last chunk lands", say_prefilled, until=prefilled(LONG),
             point=select(LONG)),
        closing("What chunking bought", say_figures),
    ),
)
