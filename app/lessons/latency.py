"""Lesson: the step budget's trade-off. The same arrivals under three max_num_batched_tokens values, with time to
first token and inter-token latency measured and plotted side by side.

Two short requests are decoding when a long prompt arrives. A small budget cuts
the prompt into many chunks: every step stays short, so the decoding requests
keep a small inter-token latency, but the prompt waits longer for its first
token (more steps, each with its own fixed cost). A large budget computes the
prompt in one step: its first token comes soonest, and that one long step is a
long pause for everyone decoding beside it. The times are the engine's own
(each step's duration), measured on the model the lesson runs.
"""

from __future__ import annotations

from kvscope.app.lessons.cues import prefilled
from kvscope.app.lessons.load import read
from kvscope.app.lessons.script import Beat, Lesson, Moment, StepRecord, closing, select
from kvscope.app.lessons.words import bars, compared, plural, spark

BUDGETS = (32, 96, 256)
LONG = "r3"
LONG_TOKENS = 200
DECODERS = ("r1", "r2")
ARRIVES_AFTER = 2       # steps of decoding before the long prompt arrives


def load(ctx) -> list:
    short = [read(name, ctx, 12, 16, offset=30 * i) for i, name in enumerate(DECODERS)]
    return [*short, read(LONG, ctx, LONG_TOKENS, 4, delay=ARRIVES_AFTER, offset=200)]


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:,.0f} ms"


def prefill_span(steps: tuple[StepRecord, ...], request_id: str) -> tuple[StepRecord, ...]:
    """The steps from the one a request arrived in to the one that gave its first token, both included."""
    arrived = next((i for i, r in enumerate(steps) if r.tokens_of(request_id) is not None), None)
    first = next((i for i, r in enumerate(steps) if (r.tokens_of(request_id) or 0) > 0), None)
    return () if arrived is None or first is None else steps[arrived:first + 1]


def time_to_first_token(steps: tuple[StepRecord, ...], request_id: str) -> float:
    """The engine's time over the request's prefill span: what its user waits for the first token."""
    return sum(r.stats.duration for r in prefill_span(steps, request_id))


def inter_token_latencies(steps: tuple[StepRecord, ...], request_id: str) -> list[float]:
    """The engine time between each two tokens of a request: the steps from one token to the next."""
    gaps, since, last = [], 0.0, 0
    for record in steps:
        count = record.tokens_of(request_id)
        if count is None:
            continue
        since += record.stats.duration
        if count > last:
            if last:                # from the first token on: before it, the wait is time to first token
                gaps.append(since)
            since, last = 0.0, count
    return gaps


def measure(moment: Moment, run: int) -> dict:
    steps = moment.run_steps(run)
    gaps = [gap for name in DECODERS for gap in inter_token_latencies(steps, name)]
    chunks = [r.stats.num_prefill_tokens for r in prefill_span(steps, LONG) if r.stats.num_prefill_tokens]
    return {"ttft": time_to_first_token(steps, LONG), "itl_max": max(gaps, default=0.0),
            "itl_mean": sum(gaps) / len(gaps) if gaps else 0.0, "steps": steps, "chunks": chunks}


def say_run(moment: Moment) -> str:
    budget = moment.info.config.max_num_batched_tokens
    m = measure(moment, moment.run)
    steps = m["steps"]
    return (f"Budget [b]{budget}[/b] tokens a step. {LONG}'s {LONG_TOKENS}-token prompt arrived after "
            f"{ARRIVES_AFTER} steps and was computed in {plural(len(m['chunks']), 'chunk')} "
            f"({' + '.join(map(str, m['chunks']))}).\n\n"
            f"  {LONG} time to first token   [b]{_ms(m['ttft'])}[/b]\n"
            f"  r1, r2 between two tokens  mean {_ms(m['itl_mean'])}, longest [b]{_ms(m['itl_max'])}[/b]\n\n"
            f"Each step's time, {plural(len(steps), 'step')}:\n  [$accent]{spark([r.stats.duration for r in steps])}"
            f"[/] (longest {_ms(max(r.stats.duration for r in steps))})")


def say_figures(moment: Moment) -> str:
    runs = [(f"budget {moment.info_at(f'budget-{b}').config.max_num_batched_tokens}",
             measure(moment, moment.earlier_runs[f"budget-{b}"])) for b in BUDGETS]
    ttft = bars([(label, m["ttft"], _ms(m["ttft"])) for label, m in runs])
    itl = bars([(label, m["itl_max"], _ms(m["itl_max"])) for label, m in runs])
    return ("[b]The figures of this run[/b]\n\n"
            f"{LONG}: time to first token\n" + "\n".join(ttft) + "\n\n"
            "r1, r2: longest gap between two tokens\n" + "\n".join(itl) + "\n\n" + conclusion(runs))


def conclusion(runs: list[tuple[str, dict]]) -> str:
    """What this run showed, from its own figures: each expected effect said only where it stands above the
    noise, and said to be hidden where it does not (a busy CPU once gave budget 32 a longer gap than 96)."""
    (small_label, small), (large_label, large) = runs[0], runs[-1]
    sooner = compared(large["ttft"], small["ttft"])
    ttft = (f"{small_label} vs {large_label}: {_ms(small['ttft'])} against {_ms(large['ttft'])}")
    if sooner > 0:
        first = (f"Here the larger budget gave {LONG} its first token sooner ({ttft}): one long step instead of "
                 "many, each with its fixed cost.")
    else:
        first = (f"Here the time to first token did not drop with the larger budget ({ttft}): "
                 + ("the difference is within this machine's noise, and a step's fixed cost dominates."
                    if sooner == 0 else "this run's noise (a busy CPU) hid the effect."))
    longer = compared(small["itl_max"], large["itl_max"])
    gaps = f"{_ms(small['itl_max'])} at {small_label}, {_ms(large['itl_max'])} at {large_label}"
    if longer > 0:
        between = (f"The larger budget made r1 and r2 wait longer between tokens ({gaps}): the long prompt's "
                   "step stalled them.")
    else:
        between = (f"The longest gap between tokens did not grow with the budget ({gaps}): "
                   + ("within the noise of this machine." if longer == 0 else
                      "this run's noise hid the effect."))
    return (f"{first} {between}{out_of_order(runs)} Where the effects stand above the noise, a smaller "
            "max_num_batched_tokens favours the time between tokens and a larger one the time to first token; "
            "vLLM's --max-num-batched-tokens is the same knob.")


def out_of_order(runs: list[tuple[str, dict]]) -> str:
    """A budget between the two ends whose figure lies beyond both by more than the noise: said, not hidden."""
    said = []
    for key, what in (("ttft", "time to first token"), ("itl_max", "longest gap")):
        ends = (runs[0][1][key], runs[-1][1][key])
        for label, m in runs[1:-1]:
            if compared(max(ends), m[key]) > 0 or compared(min(ends), m[key]) < 0:
                said.append(f"{label}'s {what}, {_ms(m[key])}, is outside both ends")
    return f" ({'; '.join(said)}: this run's noise.)" if said else ""


def _beat(budget: int, first: bool) -> Beat:
    return Beat(f"budget-{budget}", f"Budget {budget}", say_run, until=prefilled(LONG), load=load,
                config=None if first else {"max_num_batched_tokens": budget}, point=select(LONG))


LESSON = Lesson(
    name="latency",
    title="The step budget: time to first token against time between tokens",
    summary="The same arrivals under three max_num_batched_tokens budgets: time to first token and inter-token "
            "latency measured and plotted side by side.",
    config={"max_num_batched_tokens": BUDGETS[0]},
    beats=(*(_beat(budget, i == 0) for i, budget in enumerate(BUDGETS)),
           closing("Side by side", say_figures)),
)
