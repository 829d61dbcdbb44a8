"""`kvscope bench startup`: how long a new process takes until the engine can serve, and its peak memory.

A user's start is a fresh interpreter: import torch and transformers, load the weights, pack the
linear layers, load the C++ kernels (built once per machine, then cached) and allocate the KV pool.
Each repeat runs in its own process, so only the disk caches and the built kernels are warm; that is
the "warm cache" start, held to 10 s. The median is what the table reports, since one slow
start on a shared machine says little.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Run in the child. Peak RSS is the kernel's high-water mark for the child alone (KiB on Linux).
_CHILD = """
import json, resource, sys, time
start = time.perf_counter()
import torch
from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
imported = time.perf_counter()
if {threads}:
    torch.set_num_threads({threads})
engine = LLMEngine(EngineConfig(model={model!r}, device={device!r}, dtype={dtype!r}))
ready = time.perf_counter()
from kvscope.kernels import cpu
kernels = lambda device: cpu.status() if device == "cpu" else "Triton"
engine.generate(["Hello"], SamplingParams(max_tokens=1))
first = time.perf_counter()
print(json.dumps({{"import_s": imported - start, "build_s": ready - imported, "ready_s": ready - start,
                  "first_token_s": first - start, "kernels": kernels(engine.info.device),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


@dataclass(frozen=True)
class StartupTiming:
    import_s: float
    build_s: float
    ready_s: float
    first_token_s: float
    peak_rss_mb: float
    kernels: str


def time_startups(model: str, device: str, dtype: str, threads: int | None, repeats: int) -> list[StartupTiming]:
    if Path(model).exists():    # a local model directory, named from where the user stands
        model = str(Path(model).resolve())
    code = _CHILD.format(model=model, device=device, dtype=dtype, threads=threads or 0)
    timings = []
    for _ in range(repeats):
        # Not from the checkout: `python -c` puts the working directory on sys.path, and transformers would
        # take the checkout's kernels/ folder for Hugging Face's `kernels` package.
        with tempfile.TemporaryDirectory(prefix="kvscope-startup-") as outside:
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                                    cwd=outside)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the startup child failed: {last}")
        timings.append(StartupTiming(**json.loads(result.stdout.strip().splitlines()[-1])))
    return timings


def format_table(timings: list[StartupTiming], dtype: str) -> str:
    lines = [f"startup · {dtype} · {len(timings)} fresh processes · attention: {timings[0].kernels}",
             f"{'':>14} {'import':>8} {'build':>8} {'ready':>8} {'1st token':>10} {'peak RSS':>10}"]
    for index, t in enumerate(timings, 1):
        lines.append(f"{'run ' + str(index):>14} {t.import_s:>7.1f}s {t.build_s:>7.1f}s {t.ready_s:>7.1f}s "
                     f"{t.first_token_s:>9.1f}s {t.peak_rss_mb:>7.0f} MiB")
    median = {name: statistics.median(getattr(t, name) for t in timings)
              for name in ("import_s", "build_s", "ready_s", "first_token_s", "peak_rss_mb")}
    lines.append(f"{'median':>14} {median['import_s']:>7.1f}s {median['build_s']:>7.1f}s {median['ready_s']:>7.1f}s "
                 f"{median['first_token_s']:>9.1f}s {median['peak_rss_mb']:>7.0f} MiB")
    return "\n".join(lines)
