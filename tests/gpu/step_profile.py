"""Where a decode step's time goes on a GPU: host milliseconds, the GPU's busy share, and kernels launched a step.

The host launches a step and the GPU runs it; when the host takes longer to launch a step than the GPU takes to
run it, the GPU waits. Measured on a running batch of ``batch`` requests, every one of them decoding:

- step ms: a step's wall time, untraced (the mean of STEPS steps after WARM_UP), and the output tok/s it gives;
- GPU busy: the time at least one kernel, copy or memset ran during a traced step, over the untraced step time;
- host ms: a traced step's wall time less the time the host sat in a CUDA call that waits for the GPU (a
  synchronize, or a copy, which waits when it lands in pageable host memory). The tracer adds its own cost to
  every op, so this is an upper bound;
- kernels: the GPU kernels a traced step ran.

The trace is torch.profiler's (Kineto's Chrome trace), read by ``trace_figures``, which tests check on a trace
written by hand. On a CPU the same run gives host ms and no kernels.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams

STEP = "kvscope-decode-step"
WARM_UP = 3
STEPS = 8
BLOCK_SIZE = 16
STEP_BUDGET = 2048
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALLS = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class TraceFigures:
    steps: int
    host_ms: float          # a step's host time outside waits for the GPU (traced)
    gpu_busy_ms: float      # a step's time with some GPU work running
    kernels: float          # kernels a step


def waits_for_gpu(name: str) -> bool:
    """A CUDA runtime or driver call in which the host waits for the device."""
    return "Synchronize" in name or name.startswith(("cudaMemcpy", "cuMemcpy"))


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1000.0      # trace times are microseconds


def trace_figures(events: list[dict], step_name: str = STEP) -> TraceFigures:
    """Per-step means over the steps marked ``step_name`` in a Chrome trace's complete ("X") events. A step's GPU
    work is what starts between its start and the next step's (the last: the trace's end), since a step waits
    for its sampled ids before it returns."""
    complete = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in complete
                   if e.get("cat") == "user_annotation" and e.get("name") == step_name)
    if not steps:
        raise ValueError(f"the trace marks no step named {step_name!r}")
    trace_end = max(e["ts"] + e.get("dur", 0) for e in complete)
    windows = [(start, steps[i + 1][0] if i + 1 < len(steps) else trace_end) for i, (start, _) in enumerate(steps)]
    gpu = [e for e in complete if e.get("cat") in GPU_WORK]
    waits = [(e["ts"], e["ts"] + e["dur"]) for e in complete
             if e.get("cat") in HOST_CALLS and waits_for_gpu(e.get("name", ""))]
    host = busy = kernels = 0.0
    for (start, end), (_, step_end) in zip(windows, steps):
        inside = [e for e in gpu if start <= e["ts"] < end]
        kernels += sum(1 for e in inside if e["cat"] == "kernel")
        busy += _union_ms([(e["ts"], min(e["ts"] + e["dur"], end)) for e in inside])
        waited = _union_ms([(max(a, start), min(b, step_end)) for a, b in waits if a < step_end and b > start])
        host += (step_end - start) / 1000.0 - waited
    count = len(steps)
    return TraceFigures(count, host / count, busy / count, kernels / count)


@dataclass(frozen=True)
class DecodeProfile:
    batch: int
    step_ms: float
    host_ms: float
    gpu_busy: float         # share of the untraced step
    kernels: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.batch / self.step_ms * 1000.0

    def text(self) -> str:
        return (f"batch {self.batch}: step {self.step_ms:.2f} ms ({self.output_tokens_per_s:,.0f} tok/s), "
                f"host {self.host_ms:.2f} ms, GPU busy {self.gpu_busy:.0%}, {self.kernels:.0f} kernels")


def decode_profile(model, tokenizer, batch: int, *, device: str = "cuda", dtype: str = "bfloat16",
                   prompt_len: int = 128, seed: int = 0, enforce_eager: bool = False) -> DecodeProfile:
    """``batch`` requests of ``prompt_len`` random prompt tokens, prefilled, then timed and traced decode steps
    (replayed from CUDA graphs unless ``enforce_eager``)."""
    prefill_steps = -(-batch * prompt_len // STEP_BUDGET) + 1
    max_tokens = prefill_steps + WARM_UP + 2 * STEPS + 8     # every request still decoding when the trace ends
    blocks = batch * -(-(prompt_len + max_tokens) // BLOCK_SIZE)
    engine = LLMEngine(EngineConfig(device=device, dtype=dtype, block_size=BLOCK_SIZE, num_blocks=blocks,
                                    max_model_len=prompt_len + max_tokens, max_num_seqs=batch,
                                    max_num_batched_tokens=STEP_BUDGET, enable_prefix_caching=False,
                                    enforce_eager=enforce_eager),
                       model=model, tokenizer=tokenizer)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    ids = [engine.add_request([rng.randrange(1000, 40000) for _ in range(prompt_len)], params)
           for _ in range(batch)]
    try:
        while not _full_decode(engine.step().stats, batch):
            pass
        for _ in range(WARM_UP):
            engine.step()
        synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        synchronize()
        start = perf_counter()
        for _ in range(STEPS):
            _expect_full_decode(engine.step().stats, batch)
        synchronize()
        step_ms = (perf_counter() - start) / STEPS * 1000.0
        figures = _traced_steps(engine, batch, device, synchronize)
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    return DecodeProfile(batch, step_ms, figures.host_ms, figures.gpu_busy_ms / step_ms, figures.kernels)


def _traced_steps(engine, batch: int, device: str, synchronize) -> TraceFigures:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as traced:
        for _ in range(STEPS):
            with record_function(STEP):
                _expect_full_decode(engine.step().stats, batch)
        synchronize()
    with tempfile.TemporaryDirectory(prefix="kvscope-trace-") as folder:
        path = Path(folder) / "trace.json"
        traced.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return trace_figures(events)


def _full_decode(stats, batch: int) -> bool:
    return stats.num_prefill_tokens == 0 and stats.num_decode_tokens == batch


def _expect_full_decode(stats, batch: int) -> None:
    if not _full_decode(stats, batch):
        raise RuntimeError(f"a measured step was not {batch} decodes: {stats.num_prefill_tokens} prefill tokens, "
                           f"{stats.num_decode_tokens} decode tokens")
