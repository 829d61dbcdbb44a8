"""The cyclic garbage collector's policy for a process that runs an engine loop: a young generation sized for
a step, not for a script.

CPython collects its youngest generation whenever 700 more container objects have been made than freed. One
decode step at batch 256 makes a few thousand (each request's output, its sample, its batch entry, the
snapshot's views) that are alive together before the next step frees them, so every step set off at least one
young collection, each walking the ~1,600 young objects alive at that moment and everything they hold: 0.24 ms a
step of the engine thread's 2.1 ms on a FakeRunner (`kvscope bench ui`'s headless side, 1,041 collections in
1,000 steps), a tenth of its time. Nearly all of those objects die by reference counting a step later; the
collector finds no cycle among them. With room for YOUNG_THRESHOLD objects, a young collection comes every few
dozen steps and walks about as much as one did before; the older generations keep CPython's ratios to the
young one, and the heap that lives as long as the model or the server stays frozen out of every walk
(engine/model/model_runner.py, app/serve/server.py). Cyclic garbage waits for at most YOUNG_THRESHOLD objects
more before it is found: a few megabytes.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def tune_for_engine_loop() -> None:
    """Set the young generation's threshold (process-wide, as every collector setting is); the older
    generations' stay as they are."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
