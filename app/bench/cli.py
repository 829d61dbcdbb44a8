"""`kvscope bench [workloads|scheduler|logging|ui|kernels]`: the command line of every benchmark.

``kvscope bench`` alone runs the workload comparison (issue 7); ``logging``
measures the run log's cost (issue 6); ``scheduler`` and ``ui`` run the
scheduler's and the app's own micro-benchmarks; ``kernels`` times one layer's
paged attention (decode and prefill) per call; ``lessons`` times each lesson
with the real model; ``startup`` times fresh processes until the engine is ready.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import tempfile
from pathlib import Path

from kvscope.app.bench.systems import SYSTEMS
from kvscope.app.bench.workloads import WORKLOAD_NAMES
from kvscope.app.flags import add_engine_flags

MATCHED = (128, 4096)   # vLLM 0.32's CPU defaults: block size, max_num_batched_tokens
WHAT = ("workloads", "scheduler", "logging", "ui", "kernels", "attach", "lessons", "startup", "serve")
DTYPES = ("float32", "bfloat16", "float16")


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def register(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="measure kvscope against transformers, vLLM and its contiguous baseline",
        description="Run every system side by side in one process: same model, dtype, threads, prompts "
                    "and output lengths. Without WHAT, runs the workload comparison.")
    bench.add_argument("what", nargs="?", default="workloads", choices=WHAT,
                       help="workloads (default): the system comparison; scheduler: scheduler-only "
                            "micro-benchmark; logging: run log on vs off; ui: app rendering cost; "
                            "kernels: per-layer paged attention time; attach: the vLLM attach client's CPU at an event "
                            "rate and memory for a big pool; lessons: each lesson's duration; startup: a fresh "
                            "process's time until the engine is ready, and its peak memory; serve: kvscope serve "
                            "against vLLM's server under the same client and request rates")
    bench.add_argument("--workload", default="mixed", choices=(*WORKLOAD_NAMES, "all"),
                       help="for workloads and logging (default: mixed)")
    bench.add_argument("--systems", default=None,
                       help=f"comma-separated, from {','.join(SYSTEMS)} (default: each workload's own set)")
    bench.add_argument("--dtype", default=None,
                       help="float32, bfloat16 or float16; a comma-separated list runs each in turn "
                            "(default: float32; for kernels, float32,bfloat16)")
    bench.add_argument("--requests", type=positive_int, default=None,
                       help="requests per workload (prompts, for parallel-sampling; running requests, for "
                            "scheduler); default: the issue's")
    bench.add_argument("--seed", type=int, default=0, help="workload seed")
    bench.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    add_engine_flags(bench, names=("model", "device"))
    bench.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    bench.add_argument("--db", default=None, help="run log SQLite file (default: in the user data dir)")
    bench.add_argument("--no-log", action="store_true", help="do not record the kvscope runs in the run log")
    bench.add_argument("--no-floor", action="store_true", help="skip timing the forward-only floor")
    engine = bench.add_argument_group("engine settings for kvscope and vLLM alike (default: each system's own)")
    engine.add_argument("--block-size", type=positive_int, default=None, help="tokens per KV block")
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="token budget of one step")
    engine.add_argument("--cpu-threads-bind", default="none", metavar="CORES",
                        help="kvscope: pin its compute threads, one per core (none, auto, or cores like 0-1)")
    engine.add_argument("--matched", action="store_true",
                        help=f"both at vLLM's CPU defaults: --block-size {MATCHED[0]} --max-num-batched-tokens "
                             f"{MATCHED[1]} (unless those flags say otherwise)")
    peers = bench.add_argument_group("transformers peers")
    peers.add_argument("--hf-batch-size", type=positive_int, default=32,   # StaticSettings' tuned default
                       help="hf-static: requests per static batch")
    peers.add_argument("--hf-cb-max-requests", type=positive_int, default=16, help="hf-cb: most requests per step")
    peers.add_argument("--hf-cb-batch-tokens", type=positive_int, default=512, help="hf-cb: most tokens per step")
    peers.add_argument("--hf-cb-page-size", type=positive_int, default=256, help="hf-cb: tokens per cache page")
    peers.add_argument("--vllm-python", default=None,
                       help="vllm: the Python of a venv with vLLM (default: .venv-vllm/bin/python if it exists; "
                            "`make bench-vllm` creates it)")
    attach = bench.add_argument_group("attach (the vLLM attach client, on recorded events)")
    attach.add_argument("--rate", type=positive_float, default=10_000,
                        help="events per second to replay (default 10,000)")
    attach.add_argument("--seconds", type=positive_float, default=10.0, help="how long to replay them (default 10)")
    attach.add_argument("--pool-blocks", type=positive_int, default=1_000_000,
                        help="pool size for the memory figure (default 1,000,000)")
    serve = bench.add_argument_group("serve (kvscope serve against vLLM's server)")
    serve.add_argument("--rates", default="1,4",
                       help="request rates to try, requests/s, comma-separated; inf sends all at once (default 1,4)")
    serve.add_argument("--input-len", type=positive_int, default=256, help="prompt tokens (default 256)")
    serve.add_argument("--output-len", type=positive_int, default=64, help="output tokens (default 64)")
    serve.add_argument("--client", default="auto", choices=("auto", "vllm", "openai"),
                       help="vllm: `vllm bench serve` from the vLLM venv; openai: kvscope's own load generator "
                            "(default: vllm when the vLLM venv exists)")
    bench.add_argument("--repeats", type=positive_int, default=None,
                       help="logging: off/on/on/off rounds (default 1); kernels: timed calls per case (default 20); "
                            "startup: fresh processes (default 3)")
    bench.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return {"workloads": run_workloads, "scheduler": run_scheduler, "logging": run_logging,
            "ui": run_ui, "kernels": run_kernels, "attach": run_attach,
            "lessons": run_lessons, "startup": run_startup, "serve": run_serve}[args.what](args)


def run_serve(args: argparse.Namespace) -> int:
    from kvscope.app.bench.serve_bench import ServeBenchSettings, format_table, run_serve_bench
    from kvscope.app.bench.vllm_system import SystemUnavailable, find_python
    from kvscope.engine.model.loader import resolve_model_path

    rates = tuple(float(rate) for rate in args.rates.split(","))
    if not rates or any(not rate > 0 for rate in rates):
        raise SystemExit(f"kvscope bench serve: --rates takes positive numbers or inf, got {args.rates!r}")
    systems = _parse_serve_systems(args.systems)
    try:
        vllm_python = str(find_python(args.vllm_python))
    except SystemUnavailable as exc:
        if args.vllm_python or args.client == "vllm":
            raise SystemExit(f"kvscope bench serve: {exc}") from None
        print(f"kvscope bench serve: {exc}; measuring kvscope only, with kvscope's own client", file=sys.stderr)
        vllm_python, systems = None, tuple(s for s in systems if s != "vllm")
    model_dir = resolve_model_path(args.model)
    settings = ServeBenchSettings(
        model_dir=model_dir, dtype=_parse_dtypes(args.dtype, "bfloat16")[0], rates=rates,
        num_prompts=args.requests or 32, input_len=args.input_len, output_len=args.output_len,
        systems=systems, vllm_python=vllm_python, client=args.client, seed=args.seed)
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(model_dir))
    rows, notes = run_serve_bench(settings, vocab_size,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps([dataclasses.asdict(row) for row in rows]) if args.json else format_table(rows, settings, notes))
    return 1 if notes or any(row.failed for row in rows) else 0


def _parse_serve_systems(text: str | None) -> tuple[str, ...]:
    systems = tuple(s.strip() for s in (text or "kvscope,vllm").split(",") if s.strip())
    if not systems or set(systems) - {"kvscope", "vllm"}:
        raise SystemExit(f"kvscope bench serve: --systems takes kvscope and/or vllm, got {text!r}")
    return systems


def run_startup(args: argparse.Namespace) -> int:
    from kvscope.app.bench.startup_bench import format_table, time_startups

    dtype = _parse_dtypes(args.dtype, "bfloat16")[0]
    timings = time_startups(args.model, args.device, dtype, args.threads, args.repeats or 3)
    print(format_table(timings, dtype))
    return 0


def run_lessons(args: argparse.Namespace) -> int:
    from kvscope.app.bench.lessons_bench import format_table, time_lessons
    from kvscope.engine.config import EngineConfig

    dtype = _parse_dtypes(args.dtype, "auto")[0] if args.dtype else "auto"
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, device=args.device, dtype=dtype)
    load_seconds, timings = time_lessons(config, db_path=args.db, log_enabled=not args.no_log)
    print(format_table(load_seconds, timings))
    return 0


def _parse_dtypes(text: str | None, default: str = "float32") -> list[str]:
    text = default if text is None else text
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise SystemExit(f"kvscope bench: --dtype takes {', '.join(DTYPES)} (comma-separated), got {text!r}")
    return dtypes


def _parse_systems(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    systems = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise SystemExit(f"kvscope bench: unknown system {', '.join(bad) or text!r}; "
                         f"choose from {','.join(SYSTEMS)}")
    return systems


def _setup(args: argparse.Namespace):
    """Threads and device, decided once for every system; returns the device name."""
    import torch

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.model.model_runner import resolve_device

    EngineConfig(model=args.model, device=args.device)     # a bad --device fails here, in one line
    if args.threads:
        torch.set_num_threads(args.threads)
    return resolve_device(args.device).type


def _log_opener(db: str | Path | None):
    """open_log(engine) for each kvscope run: records it as any run is; warns once if the run log is off
    or stops writing (a full disk)."""
    from kvscope.app.runlog import record_run

    warned = []

    def warn(warning: str) -> None:     # once: every later run would say the same
        if not warned:
            warned.append(warning)
            print(f"kvscope bench: {warning}", file=sys.stderr, flush=True)

    def open_log(engine):
        logger = record_run(engine, source="bench", db_path=db, on_failure=warn)
        if logger.warning:
            warn(logger.warning)
        return logger

    return open_log


def _load(args: argparse.Namespace, dtype: str, device: str):
    import torch

    from kvscope.engine.model.loader import load_model

    return load_model(args.model, getattr(torch, dtype), device)


def run_workloads(args: argparse.Namespace) -> int:
    from kvscope.app.bench.harness import Bench, BenchOptions, environment_line
    from kvscope.app.bench.hf_cb import ContinuousSettings
    from kvscope.app.bench.hf_static import StaticSettings
    from kvscope.app.bench.report import add_ratios, format_table, json_lines
    from kvscope.app.bench.vllm_system import VllmSettings
    from kvscope.app.bench.workloads import build_workloads

    dtypes, systems = _parse_dtypes(args.dtype), _parse_systems(args.systems)
    workloads = build_workloads(args.workload, args.requests, args.seed)
    device = _setup(args)
    print(f"kvscope bench: {environment_line()}", file=sys.stderr)
    references = _references(args, workloads, device)
    block_size, step_budget = engine_settings(args)
    peaks = matmul_peaks(device)
    print(f"kvscope bench: matmul peak {', '.join(f'{d} {g:,.0f} GFLOP/s' for d, g in peaks.items())}",
          file=sys.stderr)
    rows, notes = [], {}
    for dtype in dtypes:
        model, tokenizer = _load(args, dtype, device)
        options = BenchOptions(
            model=args.model, device=device, dtype=dtype, systems=systems, forward_floor=not args.no_floor,
            static=StaticSettings(batch_size=args.hf_batch_size),
            continuous=ContinuousSettings(page_size=args.hf_cb_page_size,
                                          max_batch_tokens=args.hf_cb_batch_tokens,
                                          max_requests_per_batch=args.hf_cb_max_requests),
            vllm=VllmSettings(python=args.vllm_python),
            block_size=block_size, max_num_batched_tokens=step_budget, peak_gflops=peaks.get(dtype),
            cpu_threads_bind=args.cpu_threads_bind,
        )
        open_log = None if args.no_log else _log_opener(args.db)
        bench = Bench(model, tokenizer, options, open_log=open_log, references=references)
        rows += bench.run(workloads)
        notes |= bench.notes
        del bench, model
        gc.collect()
    add_ratios(rows)
    print(json_lines(rows) if args.json else format_table(rows, notes))
    return 0


def _references(args: argparse.Namespace, workloads, device: str) -> dict:
    """transformers' fp32 greedy tokens (and its bf16 agreement with them) for each greedy workload's sample:
    what every row's accuracy is scored against, made once for every dtype of the invocation."""
    from time import perf_counter

    from kvscope.app.bench.accuracy import build_reference
    from kvscope.app.bench.harness import pad_token_id

    greedy = [w for w in workloads if w.temperature <= 0]
    if not greedy:
        return {}
    start = perf_counter()
    fp32, tokenizer = _load(args, "float32", device)
    bf16, _ = _load(args, "bfloat16", device)
    references = {w.name: build_reference(fp32, bf16, w, pad_token_id(fp32, tokenizer)) for w in greedy}
    del fp32, bf16
    gc.collect()
    print(f"  accuracy reference (transformers fp32 and bf16 generate, {len(greedy)} workloads): "
          f"{perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return references


def engine_settings(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(block size, step budget) for kvscope and vLLM alike: the flags, else --matched's, else None (each
    system's own defaults)."""
    matched = MATCHED if args.matched else (None, None)
    return args.block_size or matched[0], args.max_num_batched_tokens or matched[1]


def run_logging(args: argparse.Namespace) -> int:
    from kvscope.app.bench.harness import environment_line
    from kvscope.app.bench.logging_bench import LogUnavailable, run_logging_bench
    from kvscope.app.bench.workloads import build_workloads
    from kvscope.engine import LLMEngine

    dtype = _parse_dtypes(args.dtype)[0]
    workload = build_workloads(args.workload, args.requests, args.seed)[0]
    device = _setup(args)
    print(f"kvscope bench logging: {environment_line()}", file=sys.stderr)
    model, tokenizer = _load(args, dtype, device)
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as scratch:
        # A fresh database unless --db names one, so its size is this bench's alone.
        db = Path(args.db).expanduser() if args.db else Path(scratch) / "runs.db"
        try:
            result = run_logging_bench(
                lambda config: LLMEngine(config, model=model, tokenizer=tokenizer),
                _log_opener(db), workload,
                db_path=db, model=args.model, device=device, dtype=dtype, repeats=args.repeats or 1,
                progress=lambda line: print(line, file=sys.stderr, flush=True))
        except LogUnavailable:  # the opener has printed why
            print("kvscope bench logging: nothing to measure without the run log", file=sys.stderr)
            return 2
    if not args.db:
        result.db_path = "a temporary database, now removed"
    print(json.dumps(result.as_json()) if args.json else result.text())
    return 0


def run_scheduler(args: argparse.Namespace) -> int:
    from kvscope.app.bench.scheduler import print_scheduler_bench, run_scheduler_bench

    sizes = {} if args.requests is None else {"num_requests": args.requests}
    if args.json:
        print(json.dumps({"bench": "scheduler", **run_scheduler_bench(**sizes)}))
    else:
        print_scheduler_bench(**sizes)
    return 0


def run_ui(args: argparse.Namespace) -> int:
    from kvscope.app.bench.ui import run_ui_bench
    from kvscope.engine import EngineConfig

    config = EngineConfig(model=args.model, device=args.device, dtype=_parse_dtypes(args.dtype)[0])
    sizes = {} if args.requests is None else {"num_requests": args.requests}
    if not args.json:
        run_ui_bench(config, **sizes)  # prints its own report
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        result = run_ui_bench(config, **sizes)
    print(json.dumps({"bench": "ui", **result}))
    return 0


def run_kernels(args: argparse.Namespace) -> int:
    from kvscope.app.bench.harness import environment_line
    from kvscope.app.bench.kernels_bench import copy_bandwidth, format_table, run_kernel_bench

    dtypes = tuple(_parse_dtypes(args.dtype, default="float32,bfloat16"))
    device = _setup(args)
    print(f"kvscope bench kernels: {environment_line()}", file=sys.stderr)
    progress = None if args.json else (lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    bandwidth = copy_bandwidth(device)
    peaks = matmul_peaks(device)
    rows = run_kernel_bench(dtypes=dtypes, repeats=args.repeats or 20, device=device, seed=args.seed,
                            progress=progress, copy_gb_per_s=bandwidth)
    if args.json:
        print("\n".join(json.dumps(row | {"copy_gb_per_s": bandwidth, "matmul_gflops": peaks}) for row in rows))
    else:
        print(format_table(rows, copy_gb_per_s=bandwidth, matmul_gflops=peaks))
    return 0


def matmul_peaks(device: str) -> dict[str, float]:
    """The machine's matmul throughput per dtype, on the bench's threads (app/bench/peak.py)."""
    import torch

    from kvscope.app.bench.peak import matmul_peak_gflops

    return {name: matmul_peak_gflops(getattr(torch, name), device=device) for name in ("float32", "bfloat16")}


def run_attach(args: argparse.Namespace) -> int:
    from kvscope.app.attach.bench import report, run_memory, run_rate

    if args.rate <= 0 or args.seconds <= 0 or args.pool_blocks < 1:
        raise SystemExit("kvscope bench attach: --rate, --seconds and --pool-blocks must be positive")
    rate = run_rate(args.rate, args.seconds, args.pool_blocks)
    memory = run_memory(args.pool_blocks)
    if args.json:
        print(json.dumps({"bench": "attach", **dataclasses.asdict(rate), **{f"memory_{k}": v for k, v in
                                                                            dataclasses.asdict(memory).items()}}))
    else:
        print(report(rate, memory))
    return 0
