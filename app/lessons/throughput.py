"""Lesson: throughput. Paged against contiguous on the same memory-bound pool, run live one after the other with the
same requests: tokens a second, the batch each ran, and what a step cost at that batch.

Twelve chat requests of about 80 tokens each: the 64-block teaching pool holds
them all at once when paged (5 blocks each), but only four max_model_len rows
when reserved contiguously, so the contiguous run works through them four at a
time. Paging's bigger batch is throughput only as far as a step at that batch
costs about what a smaller one does; on a CPU a step's cost grows with the
batch, which bounds the ratio, and the lesson shows the step times that say by
how much. On a GPU, a decode step reads the weights once whatever the batch,
so the freed batch comes closer to being throughput.
"""

from __future__ import annotations

from kvscope.app.lessons import words
from kvscope.app.lessons.cues import after_steps
from kvscope.app.lessons.load import ask, question
from kvscope.app.lessons.script import Beat, Lesson, Moment, closing, select
from kvscope.app.lessons.words import bars, plural

NUM_REQUESTS = 12
MAX_TOKENS = 40
LOOK_AT_STEP = 4
RUNS = (("contiguous", "contiguous"), ("paged", "paged"))


def load(ctx) -> list:
    return [ask(f"r{i + 1}", question(i), MAX_TOKENS) for i in range(NUM_REQUESTS)]


def measure(moment: Moment, run: int) -> dict:
    """A run's output tokens a second over the engine's own time, its batch, and the time of a step that only
    decoded, at the batch it ran most often."""
    steps = moment.run_steps(run)
    seconds = sum(r.stats.duration for r in steps)
    tokens = sum(count for r in steps for _, count in r.finished)     # every request of a run finishes in it
    decode_only = [r for r in steps if r.stats.num_decode_tokens and not r.stats.num_prefill_tokens]
    batch = max((r.batch for r in steps), default=0)
    at_batch = [r.stats.duration for r in decode_only if r.batch == batch] or [r.stats.duration for r in decode_only]
    return {"tokens": tokens, "seconds": seconds, "rate": tokens / seconds if seconds else 0.0, "steps": len(steps),
            "batch": batch, "mean_batch": sum(r.batch for r in steps) / len(steps) if steps else 0.0,
            "step_s": sum(at_batch) / len(at_batch) if at_batch else 0.0}


def _queues(moment: Moment, key: str | None = None) -> tuple[int, int]:
    """(running, waiting) at this step, or at the step the earlier beat ``key`` stopped at."""
    return len(moment.queued("running", key)), len(moment.queued("waiting", key))


def say_contiguous(moment: Moment) -> str:
    running, waiting = _queues(moment)
    runner = moment.info.runner
    rows = -(-runner.max_model_len // runner.block_size)
    longest = max(v.num_prompt_tokens + v.max_tokens for v in moment.snapshot.requests)
    return (f"{NUM_REQUESTS} chat requests of up to {longest} tokens each. The [b]contiguous[/b] allocator reserves "
            f"max_model_len ({runner.max_model_len} tokens, {rows} blocks) for each: the "
            f"{runner.num_device_blocks}-block pool holds {runner.num_device_blocks // rows} such runs, so "
            f"[b]{running} run[/b] and {waiting} wait. The memory bounds the batch, not the compute.")


def say_paged(moment: Moment) -> str:
    running, waiting = _queues(moment)
    used = sum(len(v.block_tables[0]) for v in moment.snapshot.requests if v.block_tables and v.queue == "running")
    before = _queues(moment, "contiguous")[0]
    return (f"The same requests, [b]paged[/b]: each takes blocks as it fills them ({used / max(running, 1):.1f} "
            f"each so far, of the pool's {moment.info.runner.num_device_blocks}), so [b]{running} run at once[/b] "
            f"({waiting} waiting) in {used} blocks. Same pool, same model: {running / max(before, 1):.1f}× the "
            "contiguous batch.")


def say_figures(moment: Moment) -> str:
    runs = [(label, measure(moment, moment.earlier_runs[key])) for key, label in RUNS]
    (_, contiguous), (_, paged) = runs
    ratio = paged["rate"] / contiguous["rate"] if contiguous["rate"] else 0.0
    step_ratio = paged["step_s"] / contiguous["step_s"] if contiguous["step_s"] else 0.0
    batch_ratio = paged["batch"] / contiguous["batch"] if contiguous["batch"] else 0.0
    rate = bars([(label, m["rate"], f"{m['rate']:,.1f} tok/s") for label, m in runs])
    batch = bars([(label, m["batch"], f"{m['batch']} (mean {m['mean_batch']:.1f})") for label, m in runs])
    step = bars([(label, m["step_s"], f"{1000 * m['step_s']:,.0f} ms at batch {m['batch']}") for label, m in runs])
    gain = words.compared(contiguous["rate"], paged["rate"])
    hidden = " Paging was slower here: this run's noise (a busy CPU) hid the effect."
    verdict = "" if gain > 0 else hidden if gain < 0 else (
        f" No gain stands above this machine's noise here: tokens a second differ by less than {words.NOISE:.0%}.")
    return ("[b]The figures of this run[/b] (the engine's own time)\n\n"
            "output tokens a second\n" + "\n".join(rate) + "\n\nbatch, most at once\n" + "\n".join(batch) +
            "\n\na step that only decodes\n" + "\n".join(step) + "\n\n"
            f"Paging ran [b]{batch_ratio:.1f}×[/b] the batch for [b]{ratio:.2f}×[/b] the tokens a second, in "
            f"{plural(paged['steps'], 'step')} against {contiguous['steps']}.{verdict} What bounds the ratio here: a "
            f"step at the bigger batch took [b]{step_ratio:.1f}×[/b] as long"
            + (", since on a CPU a step's matmuls and attention cost grows with the tokens in it; "
               if step_ratio > 1.1 else ", and the paged batch shrank as its requests finished; ")
            + "the ratio is about the mean batch ratio divided by that. On a GPU a decode step is bound by reading the "
            "weights, about the same at batch 4 as at 12, so the freed batch becomes throughput: vLLM's paper "
            "reports 2–4×. (`kvscope bench --workload overload` measured 1.40–1.51× on the development CPU.)")


LESSON = Lesson(
    name="throughput",
    title="Throughput: the batch paging frees, on the same pool",
    summary="Paged against contiguous on the same memory-bound pool, run live with the same requests: tokens a "
            "second, the batch each ran, and what bounds the ratio on a CPU.",
    config={"allocator": "contiguous"},
    beats=(
        Beat("contiguous", "Contiguous: four rows", say_contiguous, until=after_steps(LOOK_AT_STEP), load=load,
             point=select("r1")),
        Beat("paged", "Paged: everyone at once", say_paged, until=after_steps(LOOK_AT_STEP),
             config={"allocator": "paged"}, load=load, point=select("r1")),
        closing("Tokens a second, side by side", say_figures),
    ),
)
