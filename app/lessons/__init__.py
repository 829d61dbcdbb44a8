"""Lessons: scripted scenarios on the real engine, one per claim of paged attention, paused where it matters.

Each lesson is one module holding a ``LESSON`` (script.py says what one is made
of); ``LESSONS`` lists them in teaching order. ``kvscope lesson NAME`` and the
app's command palette run them on the LessonScreen through the LessonRunner.
"""

from __future__ import annotations

from kvscope.app.lessons import (
    block_tables,
    chunked_prefill,
    continuous_batching,
    copy_on_write,
    fragmentation,
    latency,
    preemption,
    prefix_sharing,
    sizing,
    sliding_window,
    throughput,
)
from kvscope.app.lessons.script import Lesson

LESSONS: dict[str, Lesson] = {module.LESSON.name: module.LESSON for module in (
    fragmentation, block_tables, prefix_sharing, copy_on_write, preemption, chunked_prefill, latency,
    continuous_batching, throughput, sizing, sliding_window,
)}
