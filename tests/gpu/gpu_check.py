"""`make gpu-check`: everything kvscope claims on a GPU, measured in one run of under 8 minutes, and one table.

    python tests/gpu/gpu_check.py [--site .gpu-site] [--quick] [--device cpu]

Run by `make gpu-check` with the GPU machine's Python and the wheels of `make gpu-wheels` on PYTHONPATH. It runs
as a plain script, not under pytest, so pyproject.toml's warnings-as-errors (kept for the suite, on the lock's
versions) cannot turn an older library's deprecation warning into a failure there. Its parts, in order; a part
that fails is a row saying why, and the others still run:

1. environment: torch, triton and transformers as found, the GPU, and what the installed wheels need that the
   machine's Python lacks (tests/gpu/gpu_wheels.py);
2. the compiled Triton kernels against the torch oracle, and the sampler on the device: its greedy and seeded draws,
   and what a call costs at batch 256 (tests/gpu/cuda_checks.py);
3. the models: kvscope's default model where it is installed, else a random-weight model of its shape, and a
   random-weight model of a 1B Llama's (Llama-3.2-1B) shape (tests/gpu/random_models.py), built on the GPU;
4. per model: exact greedy tokens against transformers on cuda (fp32), with every decode step eager and with
   decode replayed from CUDA graphs through padded batch sizes;
5. the pool sized from --gpu-memory-utilization;
6. per model, bf16: a decode step at batch 64 and 256, from CUDA graphs and eager (--enforce-eager): step ms,
   tok/s, host ms, GPU busy share, kernels a step (tests/gpu/step_profile.py);
7. per model, bf16: `kvscope bench throughput` on the mixed workload, kvscope against transformers' static
   batches (hf-static) and continuous batching (hf-cb), with the accuracy columns against transformers fp32.

``--only graphs`` runs parts 1, 3, 4's graphs row and 6: what the CUDA graphs must pass before ``enforce_eager``
may default to off, in about a third of the time, for a session with only a few minutes of GPU left.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import cuda_checks
import gpu_wheels
import random_models
import step_profile
import torch

from kvscope.engine.model.loader import ModelError, load_model, resolve_model_path

BUDGET_S = 450          # `make gpu-check` stops the run at 480 s
BATCHES = (64, 256)
QUICK_BATCHES = (2, 4)
QUICK_REQUESTS = 4
BENCH_SYSTEMS = ("kvscope-paged", "hf-static", "hf-cb")
# transformers' peers sized for a GPU rather than the bench's CPU defaults: the whole mixed workload in one
# static batch, and continuous batching free to run it all at once.
BENCH_PEERS = ("--hf-batch-size", "64", "--hf-cb-max-requests", "64", "--hf-cb-batch-tokens", "2048")


class Table:
    """The rows of the one table: part, model, result, detail."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []
        self.start = time.perf_counter()

    def add(self, part: str, model: str, passed: bool | None, detail: str) -> None:
        result = "ok" if passed else ("-" if passed is None else "FAILED")
        self.rows.append((part, model, result, detail))
        print(f"[{self.elapsed():5.0f}s] {part} · {model} · {result} · {detail}", flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return BUDGET_S - self.elapsed()

    def run(self, part: str, model: str, action, *args) -> None:
        """One part, ``action(*args)``: its Outcome as a row, or the exception that stopped it."""
        try:
            outcome = action(*args)
        except Exception as exc:    # a part's failure is a row; the others still run
            traceback.print_exc()
            self.add(part, model, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''}")
            return
        self.add(part, model, outcome.passed, outcome.text)

    def text(self) -> str:
        header = ("part", "model", "result", "detail")
        widths = [max(len(row[i]) for row in [header, *self.rows]) for i in range(3)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]
                 for row in [header, *self.rows]]
        return "\n".join(lines)

    @property
    def failed(self) -> bool:
        return any(row[2] == "FAILED" for row in self.rows)


def environment(table: Table, site: Path | None, device: str) -> bool:
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "missing"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU"
    usable = device == "cpu" or (torch.cuda.is_available() and triton_version != "missing")
    table.add("environment", "-", usable,
              f"{gpu}; torch {torch.__version__}, triton {triton_version}, transformers {transformers.__version__}, "
              f"python {sys.version.split()[0]}")
    if site is not None:
        unmet = gpu_wheels.unmet_requirements(site)
        table.add("wheels", "-", not unmet, "; ".join(unmet) if unmet else f"every requirement of {site.name}/ met")
    return usable


def models(models_dir: Path, quick: bool, device: str) -> list[tuple[str, str]]:
    """(label, folder) for each model the check runs: the default model where it is installed, else a random one
    of its shape, and a random one of the 1B's shape; tiny stand-ins of both shapes with ``quick``."""
    default = None
    if not quick:
        try:
            default = resolve_model_path("default")
        except ModelError:
            pass
    chosen = []
    for name, folder, shape in (("SmolLM2-135M", default, random_models.SMOLLM2_135M),
                                ("Llama-3.2-1B", None, random_models.LLAMA_3_2_1B)):
        if folder is None:
            overrides = random_models.tiny(shape) if quick else {}
            folder = str(random_models.build(shape, models_dir / shape.name, device=device, **overrides))
            name = f"{name} shape, {'tiny ' if quick else ''}random"
        chosen.append((name, folder))
    return chosen


def per_model_checks(table: Table, label: str, folder: str, first: bool, device: str, batches,
                     graphs_only: bool = False) -> None:
    try:
        _per_model_checks(table, label, folder, first, device, batches, graphs_only)
    except Exception as exc:    # loading failed, or a part broke the CUDA context: a row, then the next model
        traceback.print_exc()
        table.add("model", label, False, f"{type(exc).__name__}: {str(exc)[:150]}")
    cuda_checks.free_gpu_memory()


def _per_model_checks(table: Table, label: str, folder: str, first: bool, device: str, batches,
                      graphs_only: bool) -> None:
    fp32, tokenizer = load_model(folder, torch.float32, device)
    if not graphs_only:
        table.run("exact tokens vs transformers", label, cuda_checks.exact_tokens, fp32, tokenizer)
    if device == "cuda":
        table.run("exact tokens, decode from CUDA graphs", label, cuda_checks.graphs_exact_tokens, fp32, tokenizer)
    del fp32
    cuda_checks.free_gpu_memory()
    bf16, tokenizer = load_model(folder, torch.bfloat16, device)
    if first and device == "cuda" and not graphs_only:
        table.run("pool from --gpu-memory-utilization", label, cuda_checks.pool_sizing, bf16, tokenizer)
    for batch in batches:
        table.run(f"decode step, batch {batch}, graphs", label, _profile, bf16, tokenizer, batch, device, False)
        table.run(f"decode step, batch {batch}, eager", label, _profile, bf16, tokenizer, batch, device, True)
    del bf16
    cuda_checks.free_gpu_memory()


def _profile(model, tokenizer, batch: int, device: str, enforce_eager: bool) -> cuda_checks.Outcome:
    profile = step_profile.decode_profile(model, tokenizer, batch, device=device, enforce_eager=enforce_eager)
    return cuda_checks.Outcome(True, profile.text())


def bench(table: Table, label: str, folder: str, device: str, requests: int | None) -> None:
    """`kvscope bench throughput` in its own process (outside the checkout, as every child process starts); if it
    fails with hf-cb, once more without it, so one peer's failure does not hide the others."""
    systems = list(BENCH_SYSTEMS)
    while table.left() > 30:
        rows, error, timed_out = _bench_rows(folder, systems, device, requests, timeout=table.left() - 10)
        if rows is not None:
            for row in rows:
                table.add(f"bench mixed bf16 {row['system']}", label, row.get("not_run") is None, _bench_detail(row))
            return
        if timed_out or len(systems) == 1:
            table.add(f"bench mixed bf16 {','.join(systems)}", label, False, error)
            return
        table.add(f"bench mixed bf16 {systems.pop()}", label, False, error)
    table.add("bench mixed bf16", label, False, f"not run: {table.left():.0f}s of the budget left")


def _bench_rows(folder: str, systems: list[str], device: str, requests: int | None,
                timeout: float) -> tuple[list[dict] | None, str, bool]:
    """(the rows, or None with why, and whether it ran out of time)."""
    command = [sys.executable, "-m", "kvscope", "bench", "throughput", "--model", folder, "--device", device,
               "--workload", "mixed", "--dtype", "bfloat16", "--systems", ",".join(systems), "--no-log",
               "--no-floor", "--json", *BENCH_PEERS, *(("--requests", str(requests)) if requests else ())]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                cwd=tempfile.gettempdir(), env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f}s (the check's {BUDGET_S}s budget)", True
    sys.stderr.write(result.stderr[-4000:])
    if result.returncode:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        return None, f"exit {result.returncode}: {lines[-1][:150] if lines else ''}", False
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")], "", False


def _bench_detail(row: dict) -> str:
    if row.get("not_run"):
        return f"not run: {row['not_run']}"
    parts = [f"{row['output_tokens_per_s']:,.0f} out tok/s", f"{row['wall_s']:.1f}s"]
    if row.get("paged_ratio"):
        parts.append(f"kvscope-paged is {row['paged_ratio']:.2f}x this")
    if row.get("itl_p50_s") is not None:
        parts.append(f"ITL p50 {row['itl_p50_s'] * 1000:.1f} ms")
    if row.get("first_token_agreement") is not None:
        mark = " (below transformers bf16)" if row.get("below_transformers_bf16") else ""
        parts.append(f"vs transformers fp32: first {row['first_token_agreement']}/{row['accuracy_sample']}, "
                     f"lead {row['mean_leading_agreement']:.1f}{mark}")
    if row.get("engine_overhead") is not None:
        parts.append(f"{row['engine_overhead']:.0%} of step time outside the forward")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=None, help="the folder the wheels were installed into")
    parser.add_argument("--models", type=Path, default=None,
                        help="where random-weight models are built (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny stand-ins of the shapes, batches {QUICK_BATCHES}, {QUICK_REQUESTS} bench "
                             "requests: the check's own plumbing, in a minute")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run of everything but the kernels and the pool sizing (with --quick)")
    parser.add_argument("--only", choices=("graphs",), default=None,
                        help="graphs: only what the CUDA graphs must pass (exact tokens through padded replays, "
                             "decode steps from graphs beside eager)")
    args = parser.parse_args(argv)
    graphs_only = args.only == "graphs"
    table = Table()
    if environment(table, args.site, args.device):
        if args.device == "cuda" and not graphs_only:
            table.run("Triton kernels vs torch oracle", "-", cuda_checks.kernels_against_oracle)
        if not graphs_only:
            table.run("sampler on the device", "-", cuda_checks.sampler_on_device, args.device)
        with tempfile.TemporaryDirectory(prefix="kvscope-gpu-models-") as scratch:
            try:
                chosen = models(args.models or Path(scratch), args.quick, args.device)
            except Exception as exc:
                traceback.print_exc()
                table.add("models", "-", False, f"{type(exc).__name__}: {str(exc)[:150]}")
                chosen = []
            for index, (label, folder) in enumerate(chosen):
                per_model_checks(table, label, folder, index == 0, args.device,
                                 QUICK_BATCHES if args.quick else BATCHES, graphs_only)
            for label, folder in chosen if not graphs_only else ():
                bench(table, label, folder, args.device, QUICK_REQUESTS if args.quick else None)
    print(f"\ngpu-check, {table.elapsed():.0f}s\n{table.text()}")
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
