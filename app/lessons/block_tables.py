"""Lesson: block tables. Logical blocks in order, physical blocks wherever the free queue had one.

A fresh free queue hands out 0, 1, 2, …, which looks contiguous, so the lesson
first lets requests grow and finish: a growing request takes whatever block
is at the front of the free queue, and a finished request's blocks go back to
the front. A late request then gets a table such as 8 → 2 → 3 → 9 → 10. Prefix
caching is off here, so a freed block is plainly free and handed out first.
"""

from __future__ import annotations

from kvscope.app.lessons.cues import after_steps, is_running
from kvscope.app.lessons.load import read
from kvscope.app.lessons.script import Beat, Highlight, Lesson, Moment, closing, select
from kvscope.app.lessons.words import arrows, figures, plural

# name, prompt tokens, tokens to generate
FIRST = (("r1", 29, 24), ("r2", 20, 4), ("r3", 40, 20), ("r4", 20, 4))
LATE = ("r5", 70, 8)


def load_first(ctx) -> list:
    return [read(name, ctx, tokens, output, offset=40 * i) for i, (name, tokens, output) in enumerate(FIRST)]


def load_late(ctx) -> list:
    name, tokens, output = LATE
    return [read(name, ctx, tokens, output, offset=200)]


def scattered(table) -> int:
    """Entries of a block table whose physical block is not the one right after the entry before."""
    return sum(1 for a, b in zip(table, table[1:]) if b != a + 1)


def grew_apart(result) -> bool:
    """r1's table holds a block that is not adjacent to the one before it."""
    view = next((v for v in result.snapshot.requests if v.request_id == "r1"), None)
    return view is not None and bool(view.block_tables) and scattered(view.block_tables[0]) > 0


def say_fresh(moment: Moment) -> str:
    tables = ", ".join(f"{v.request_id} {arrows(v.block_tables[0])}" for v in moment.snapshot.requests
                       if v.block_tables)
    return (f"Four requests arrive. A fresh free queue hands out blocks in order: {tables}. It looks "
            "contiguous only because the pool was empty. Each request's [b]block table[/b] maps its logical "
            "blocks 0, 1, 2… to these physical ones.")


def say_grew(moment: Moment) -> str:
    table = moment.table("r1")
    return (f"r1 filled its last block and took the one at the front of the free queue: its table is now "
            f"[b]{arrows(table)}[/b]. Logical blocks 0 to {len(table) - 1} stay in order; the physical ones "
            "need not be adjacent, and attention never notices.")


def say_late(moment: Moment) -> str:
    table = moment.table(LATE[0])
    done = [request_id for record in moment.run_steps() for request_id, _ in record.finished]
    return (f"{' and '.join(done) or 'Nobody'} finished and their blocks went back to the front of the free "
            f"queue. {LATE[0]}'s prompt "
            f"needs {plural(len(table), 'block')}, and its table is [b]{arrows(table)}[/b]: "
            f"{plural(scattered(table), 'jump')} across the pool. The kernel reads K and V through the table, so "
            "where the blocks lie costs nothing, and no request ever waits for a contiguous run of free memory.")


def say_figures(moment: Moment) -> str:
    late = moment.earlier["late"].snapshot
    entries = [table for view in late.requests for table in view.block_tables if table]
    jumps = sum(scattered(table) for table in entries)
    links = sum(max(len(table) - 1, 0) for table in entries)
    table = next(v.block_tables[0] for v in late.requests if v.request_id == LATE[0])
    steps = moment.run_steps()
    peak = max(record.stats.num_total_blocks - record.stats.num_free_blocks for record in steps)
    return figures([("requests", str(len(FIRST) + 1)), ("steps", str(len(steps))),
                    ("peak blocks in use", f"{peak} of {steps[-1].stats.num_total_blocks}"),
                    (f"jumps in {LATE[0]}'s table", f"{scattered(table)} of its {len(table) - 1} links"),
                    ("jumps in every table then", f"{jumps} of {links} links")],
                   "Paging turns \"find room for this request\" into \"find any free block\": with blocks of "
                   f"{late.block_size} tokens, no free space is ever too fragmented to use.")


LESSON = Lesson(
    name="block-tables",
    title="Block tables: logical order, physical anywhere",
    summary="Logical blocks mapped to physical blocks scattered across the pool, and why that costs nothing.",
    config={"enable_prefix_caching": False},
    beats=(
        Beat("fresh", "A fresh pool hands out 0, 1, 2…", say_fresh, until=after_steps(1), load=load_first,
             point=lambda m: Highlight(blocks=tuple(b for v in m.snapshot.requests for b in v.block_tables[0]))),
        Beat("grew", "A request grows into the next free block", say_grew, until=grew_apart,
             point=lambda m: Highlight("r1", m.table("r1")[-1:])),
        Beat("late", "A late request gets the holes", say_late, until=is_running(LATE[0]), load=load_late,
             point=select(LATE[0])),
        closing("Where the blocks went", say_figures),
    ),
)
