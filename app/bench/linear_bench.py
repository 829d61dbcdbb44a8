"""`kvscope bench kernels`' linear table: kvscope's packed bf16 linear against oneDNN's, per call, with accuracy.

The engine's bf16 linears run on kvscope's own C++ linear because it keeps their outputs in fp32
(engine/model/precision.py), which oneDNN's bf16 linear cannot (it rounds them to bf16). This table says what
that costs: for SmolLM2-135M's four linear shapes, at the row counts of a decode (1, 8, 32 sequences) and of
prefill steps (256, 1024 tokens), it times

- ``kvscope``: the linear as the engine calls it (fp32 activations in, fp32 sums out; AMX tiles from
  ``cpu.AMX_MIN_ROWS`` rows up where the CPU has them),
- ``vdpbf16ps``: the same op kept off AMX, the path every row count took before AMX (and the one a CPU without
  AMX takes),
- ``oneDNN``: torch's prepacked bf16 linear (``mkldnn._linear_pointwise``, what torch.compile's freezing uses) on
  bf16 activations, its output bf16,

interleaved call by call so that a noisy moment hits them all, and each after a write of 8 MiB elsewhere: in a
model the other layers' weights pass through the core's cache between two calls on one layer, and without it
whichever path ran second read a weight the first had just brought in (1.6x faster at one row). Wall time and
the process's CPU time per call (the fairer figure on a shared machine), the ratio of CPU times against
oneDNN's, and the largest |error| of each output against the float64 product of the fp32 input and the bf16
weight, the product the model means: vdpbf16ps and oneDNN round the input to bf16 (and oneDNN its output), AMX
takes it as two bf16 parts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvscope.app.bench.kernels_bench import table_header, table_row
from kvscope.kernels import cpu

# SmolLM2-135M's linears as (in_features, out_features): gate/up, down, q/o, k/v.
SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192))
ROWS = (1, 8, 32, 256, 1024)
_NEVER = 2**62  # an amx_min_rows no call reaches: the vdpbf16ps path
_EVICT_BYTES = 8 * 2**20  # past a core's L2


def linear_calls(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The implementations to time, by name, each computing x @ weight.T for fp32 x and a bf16 weight."""
    calls = {}
    if cpu.linear_available():
        packed = cpu.pack_linear_weight(weight)
        out_features = weight.shape[0]
        calls["kvscope"] = lambda: cpu.linear(x, packed, out_features, out_dtype=torch.float32)
        if cpu.has_amx():
            calls["vdpbf16ps"] = lambda: cpu.linear(x, packed, out_features, out_dtype=torch.float32,
                                                    amx_min_rows=_NEVER)
    x_bf16 = x.to(torch.bfloat16)
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        onednn_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        calls["oneDNN"] = lambda: torch.ops.mkldnn._linear_pointwise(x_bf16, onednn_weight, None, "none", [], "")
    else:
        calls["torch"] = lambda: torch.nn.functional.linear(x_bf16, weight)
    return calls


def run_linear_bench(shapes=SHAPES, rows=ROWS, repeats: int = 20, warmup: int = 3, seed: int = 0,
                     progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per (shape, row count, implementation)."""
    gen = torch.Generator().manual_seed(seed)
    results = []
    for in_features, out_features in shapes:
        weight = (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5).to(torch.bfloat16)
        for m in rows:
            x = torch.randn(m, in_features, generator=gen)
            reference = x.double() @ weight.double().T
            calls = linear_calls(x, weight)
            wall, cpu_times = _time_interleaved(calls, repeats, warmup)
            baseline = next(statistics.median(cpu_times[name]) for name in ("oneDNN", "torch") if name in calls)
            for name, call in calls.items():
                row = {"bench": "kernels", "kernel": "linear", "in": in_features, "out": out_features, "rows": m,
                       "path": name, "median_ms": statistics.median(wall[name]) * 1e3,
                       "cpu_ms": statistics.median(cpu_times[name]) * 1e3,
                       "max_abs_error": (call().double() - reference).abs().max().item()}
                row["of_onednn"] = statistics.median(cpu_times[name]) / baseline
                results.append(row)
                if progress:
                    progress(table_row(row, _COLUMNS))
    return results


def _time_interleaved(calls: dict, repeats: int, warmup: int) -> tuple[dict, dict]:
    """Wall and process CPU seconds of each call per repeat, the calls taking turns."""
    wall = {name: [] for name in calls}
    cpu_times = {name: [] for name in calls}
    elsewhere = torch.empty(_EVICT_BYTES // 4)
    for i in range(warmup + repeats):
        for name, call in calls.items():
            elsewhere.fill_(i)
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            if i >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu_times[name].append(time.process_time() - start_cpu)
    return wall, cpu_times


_COLUMNS = (("in", 5, "d"), ("out", 5, "d"), ("rows", 5, "d"), ("path", 9, "s"), ("median_ms", 9, ".3f"),
            ("cpu_ms", 8, ".3f"), ("of_onednn", 9, ".2f"), ("max_abs_error", 10, ".2e"))
_HEADERS = {"median_ms": "median ms", "cpu_ms": "CPU ms", "of_onednn": "x oneDNN", "max_abs_error": "max |err|"}


def format_table(rows: list[dict]) -> str:
    header = table_header(_COLUMNS, _HEADERS)
    amx = f"AMX from {cpu.AMX_MIN_ROWS} rows" if cpu.linear_available() and cpu.has_amx() else "no AMX"
    title = (f"bf16 linear, SmolLM2-135M's shapes, one call · kvscope fp32 out ({amx}) vs oneDNN bf16 out · "
             f"{torch.get_num_threads()} torch threads")
    note = ("x oneDNN: CPU time against oneDNN's; max |err|: against the float64 product of the fp32 input and "
            "the bf16 weight (vdpbf16ps and oneDNN round the input to bf16, oneDNN its output too)")
    return "\n".join([title, header, *(table_row(row, _COLUMNS) for row in rows), note])
