"""Which cores the engine's compute threads run on: one thread per core, pinned, as vLLM's CPU worker does.

Unpinned, the OS moves torch's OpenMP threads between cores, and on a busy machine stacks two of them on one
core while every parallel op ends at a barrier waiting for the slower. vLLM pins each thread
(``VLLM_CPU_OMP_THREADS_BIND``); ``--cpu-threads-bind`` does the same for kvscope:

- ``none`` (default): leave placement to the OS;
- ``auto``: torch's thread count, each on one of the first cores this process may use; nothing is pinned when
  there are more threads than cores (pinning two to a core would only make them take turns);
- a core list such as ``0-1`` or ``0,2``: one thread on each, and torch runs that many threads.

Threads are pinned from the thread that steps the runner, at its first step (the OpenMP team belongs to the
thread that runs the parallel regions). That thread itself is then on the first core, and threads or processes it
starts later inherit that: a caller that starts other work from it (the bench's vLLM) widens the child's
affinity again.

**One team.** Each thread that runs a parallel region keeps an OpenMP team of its own for as long as it lives,
and GNU OpenMP (torch's CPU wheels) stops its workers spinning between regions as soon as the process has more
such threads than cores: they sleep, and every parallel op then pays their wake-up. A model loaded on the main
thread and stepped from another (`kvscope serve`'s engine loop, the window's engine thread) left two teams on
this 2-core machine: a 273-token prefill took 225 ms instead of 150, an elementwise op three times as long.
So the runner is built on a thread that ends with the build (``built_apart``), and the only team left is the
stepping thread's.

Why not pinned by default: several kvscope processes on one machine (the test suite's workers, a bench beside
the app) would each put their stepping thread on the same first core, and on the shared 2-core machine this was
built on no run showed pinning faster (docs/performance-levers.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from kvscope.engine.config import ConfigError, parse_cores
from kvscope.kernels import cpu as cpu_kernels

Built = TypeVar("Built")


def allowed_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def chosen_cores(setting: str, threads: int | None = None) -> list[int]:
    """The cores ``setting`` pins to (empty: pin nothing)."""
    if setting == "none":
        return []
    allowed = allowed_cores()
    if setting == "auto":
        threads = threads or torch.get_num_threads()
        return allowed[:threads] if 1 <= threads <= len(allowed) else []
    cores = parse_cores(setting)
    outside = [core for core in cores if core not in allowed]
    if outside and allowed:
        raise ConfigError(f"cpu_threads_bind: core(s) {outside} are not available to this process "
                          f"(it may use {allowed}); use auto or a list of those")
    return cores


def pin(cores: list[int]) -> list[int]:
    """Pin the calling thread's compute threads to ``cores`` (chosen_cores); returns the cores they are on
    (empty: not pinned)."""
    if not cores or not cpu_kernels.available():
        return []
    bound = cpu_kernels.bind_threads(cores)
    return cores if all(core >= 0 for core in bound) else []


def built_apart(build: Callable[[], Built]) -> Built:
    """``build()`` run on a thread of its own that ends with it (see the module's doc): its OpenMP team, with the
    parallel work of loading, packing and sizing, goes with it. Whatever ``build`` raises is raised here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, build()))
        except BaseException as exc:  # handed to the caller as it is
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="kvscope-model-build", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)     # in steps, so that Ctrl+C reaches the caller during a long load
    built, value = outcome[0]
    if not built:
        raise value
    return value
