"""Lesson: copy-on-write. Four samples of one prompt share its blocks until one of them must write.

Parallel sampling (n = 4) computes the prompt once: when it is done, the four
samples' block tables point at the same blocks (ref count 4). Full blocks are
never written again, so they stay shared for good. The last block is partly
filled, and each sample's next token goes into it: the first writers get a
copy of it (copy-on-write), the last one keeps the original.
"""

from __future__ import annotations

from kvscope.app.lessons.cues import prefilled
from kvscope.app.lessons.load import read
from kvscope.app.lessons.script import Beat, Highlight, Lesson, Moment, closing
from kvscope.app.lessons.words import arrows, figures, plural

NAME = "r1"
SAMPLES = 4
PROMPT_TOKENS = 40      # two full blocks of 16 and a last block holding 8
MAX_TOKENS = 12


def load(ctx) -> list:
    return [read(NAME, ctx, PROMPT_TOKENS, MAX_TOKENS, n=SAMPLES)]


def copied(result) -> bool:
    """The samples' last blocks are no longer one shared block."""
    view = next((v for v in result.snapshot.requests if v.request_id == NAME), None)
    return view is not None and len({table[-1] for table in view.block_tables if table}) > 1


def copies(moment: Moment) -> list[tuple[int, int]]:
    """(source, copy) of each copy made: where a sample's table now differs from the shared one at the fork."""
    shared = moment.earlier["fork"].snapshot
    original = next(v for v in shared.requests if v.request_id == NAME).block_tables[0]
    made = []
    for table in moment.view(NAME).block_tables:
        made += [(a, b) for a, b in zip(original, table) if a != b]
    return made


def say_fork(moment: Moment) -> str:
    view = moment.view(NAME)
    table = view.block_tables[0]
    refs = int(moment.snapshot.ref_counts[table[0]])
    return (f"One prompt of {view.num_prompt_tokens} tokens, {SAMPLES} samples (n = {SAMPLES}). The prompt was "
            f"computed once, and all {SAMPLES} samples' block tables point at the same {plural(len(table), 'block')}, "
            f"{arrows(table)}: each shows its ref count, [b]{refs}[/b]. The last one holds "
            f"{int(moment.snapshot.block_fill[table[-1]])} of {moment.snapshot.block_size} slots.")


def say_copied(moment: Moment) -> str:
    made = copies(moment)
    shared = [b for b in moment.view(NAME).block_tables[0] if moment.snapshot.ref_counts[b] > 1]
    pairs = ", ".join(f"{a}→{b}" for a, b in made)
    return (f"Each sample now writes its own first token into the last block, which {SAMPLES} tables share. The "
            f"first writers get a copy: [b]copy-on-write {pairs}[/b] ({len(made)} "
            f"{'copy' if len(made) == 1 else 'copies'}); the last "
            f"writer keeps the original. The {plural(len(shared), 'full block')} {arrows(shared)} stay shared: "
            "nothing in them will change.")


def say_figures(moment: Moment) -> str:
    fork = moment.earlier["fork"]
    view = next(v for v in fork.snapshot.requests if v.request_id == NAME)
    alone = -(-(view.num_prompt_tokens + MAX_TOKENS - 1) // fork.snapshot.block_size)
    made = copies(Moment(moment.earlier["copied"], moment.steps, moment.earlier, moment.run))
    steps = moment.run_steps()
    peak = max(record.stats.num_total_blocks - record.stats.num_free_blocks for record in steps)
    return figures([("samples", f"{SAMPLES} × {MAX_TOKENS} tokens"), ("copied on write", plural(len(made), "block")),
                    ("peak blocks in use", str(peak)), (f"{SAMPLES} lone requests", f"{SAMPLES * alone} blocks"),
                    ("steps", str(len(steps)))],
                   "Shared prompt blocks are why parallel sampling and beam search fit in memory: only what "
                   "differs is stored per sample.")


def _copied_blocks(moment: Moment) -> tuple[int, ...]:
    return tuple(b for pair in copies(moment) for b in pair)


LESSON = Lesson(
    name="copy-on-write",
    title="Copy-on-write: parallel samples share a prompt",
    summary="Parallel sampling (n=4): prompt blocks with ref count 4, and the moment the last one is copied.",
    beats=(
        Beat("fork", "Four samples, one prompt", say_fork, until=prefilled(NAME), load=load,
             point=lambda m: Highlight(NAME, m.table(NAME))),
        Beat("copied", "The first write to a shared block", say_copied, until=copied,
             point=lambda m: Highlight(NAME, _copied_blocks(m))),
        closing("What sharing saved", say_figures),
    ),
)
