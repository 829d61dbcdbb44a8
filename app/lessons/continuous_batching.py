"""Lesson: continuous batching. The batch is rebuilt every step: requests join and leave between any two steps.

At most four requests run at once (max_num_seqs = 4). Six requests of
different lengths arrive; when one finishes, a waiting one takes its place in
the very next step instead of waiting for the whole batch to drain. The closing
figures set the run's step count against what static batches of four would
have taken with the same requests.
"""

from __future__ import annotations

from kvscope.app.lessons.cues import after_steps, has_finished, is_running
from kvscope.app.lessons.load import ask, question
from kvscope.app.lessons.script import Beat, Lesson, Moment, closing, select
from kvscope.app.lessons.words import figures, plural

BATCH = 4
# name, tokens to generate, steps after the start it arrives
REQUESTS = (("r1", 14, 0), ("r2", 4, 0), ("r3", 9, 0), ("r4", 17, 0), ("r5", 10, 0), ("r6", 6, 3))


def load(ctx) -> list:
    return [ask(name, question(i), tokens, delay=delay) for i, (name, tokens, delay) in enumerate(REQUESTS)]


def say_full(moment: Moment) -> str:
    running, waiting = moment.queued("running"), moment.queued("waiting")
    return (f"{', '.join(running)} are running: the batch is full (max_num_seqs = {BATCH}). "
            f"{', '.join(waiting) or 'Nobody'} {'waits' if len(waiting) == 1 else 'wait'} for a place. Each step "
            f"computes one token for every running request.{_cached_note(moment)}")


def _cached_note(moment: Moment) -> str:
    """Why the queues say "cached 16" for requests that share no text: the chat template's system prompt."""
    cached = max((v.num_cached_tokens for v in moment.snapshot.requests), default=0)
    return (f" (The queues' [i]cached {cached}[/i]: the chat template starts every conversation with the same "
            "default system prompt, so a later request finds those tokens' blocks in the prefix cache.)"
            if cached else "")


def say_left(moment: Moment) -> str:
    return (f"r2 finished after {plural(REQUESTS[1][1], 'token')} and left the batch at the end of step "
            f"{moment.stats.step}. Its blocks are free and its place is open now, not when the whole batch is done.")


def say_joined(moment: Moment) -> str:
    running = moment.queued("running")
    return (f"…and in the very next step, {moment.stats.step}, r5 joined the batch while "
            f"{', '.join(r for r in running if r != 'r5')} carried on. The scheduler rebuilds the batch every step: "
            f"that is [b]continuous batching[/b].{_cached_note(moment)}")


def static_steps(lengths: list[int]) -> int:
    """Steps static batches of BATCH would take: each batch decodes until its longest request is done."""
    return sum(max(lengths[i:i + BATCH]) for i in range(0, len(lengths), BATCH))


def say_figures(moment: Moment) -> str:
    steps = moment.run_steps()
    lengths = [tokens for _, tokens, _ in REQUESTS]
    static = static_steps(lengths)
    busy = sum(r.batch for r in steps)
    return figures([("tokens asked", " + ".join(map(str, lengths))),
                    ("continuous", f"{plural(len(steps), 'step')}, mean batch {busy / len(steps):.1f}"),
                    (f"static, {BATCH} a batch", f"about {plural(static, 'step')}")],
                   "A static batch runs until its longest request is done: the short ones sit finished while "
                   "their places stay empty, and the next batch waits.")


LESSON = Lesson(
    name="continuous-batching",
    title="Continuous batching: join and leave at every step",
    summary="Requests joining and leaving the batch every step, against what a static batch would wait for.",
    config={"max_num_seqs": BATCH},
    beats=(
        Beat("full", "A full batch", say_full, until=after_steps(2), load=load, point=select("r5")),
        Beat("left", "One request leaves", say_left, until=has_finished("r2")),
        Beat("joined", "Another joins at once", say_joined, until=is_running("r5"), point=select("r5")),
        closing("Against static batches", say_figures),
    ),
)
