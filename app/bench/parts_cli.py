"""`kvscope bench host | ui | hybrid | kernels | scheduler | attach | lessons | startup`: one part at a time.

``host`` and ``ui`` are the host-side scoreboard (the work around each forward, and the window's); ``hybrid``
what a hybrid KV cache saves on a sliding-window model; ``kernels`` times one layer's paged attention and the bf16
linear (against oneDNN's, on CPU); ``scheduler`` one step() without the model; ``attach`` the vLLM attach
client; ``lessons`` each lesson with the real model; ``startup`` a fresh process until the engine is ready.
Each registers its own flags; everything heavy (torch, transformers, textual) is imported when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvscope.app.bench.options import (
    add_dtype_flag,
    add_json_flag,
    add_model_flags,
    add_repeats_flag,
    int_list,
    parse_dtypes,
    positive_float,
    positive_int,
    setup_torch,
)
from kvscope.app.bench.scoreboard import HostSettings, HybridSettings, UiSettings


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def _add_setting_flags(parser: argparse.ArgumentParser, settings: type) -> None:
    """A flag for each of ``settings``' fields that has help text (app/bench/scoreboard.py), of its default's kind."""
    kinds = {tuple: int_list, int: positive_int, float: positive_float}
    for spec in dataclasses.fields(settings):
        if "help" in spec.metadata:
            shown = ",".join(map(str, spec.default)) if isinstance(spec.default, tuple) else spec.default
            parser.add_argument(f"--{spec.name.replace('_', '-')}", type=kinds[type(spec.default)],
                                default=spec.default, help=f"{spec.metadata['help']} (default {shown})")


def _settings(settings: type, args: argparse.Namespace, **more):
    """``settings`` made from the flags _add_setting_flags added, and ``more``."""
    flags = {spec.name: getattr(args, spec.name) for spec in dataclasses.fields(settings) if "help" in spec.metadata}
    return settings(**flags, **more)


def _add_settings_bench(subparsers, name: str, settings: type, run, *, help: str,
                        description: str) -> argparse.ArgumentParser:
    """The subcommand ``name``: a flag per field of ``settings`` that has help text, and --json; ``run`` runs it."""
    parser = subparsers.add_parser(name, help=help, description=description)
    _add_setting_flags(parser, settings)
    add_json_flag(parser)
    parser.set_defaults(func=run)
    return parser


def register_hybrid(subparsers) -> None:
    _add_settings_bench(
        subparsers, "hybrid", HybridSettings, run_hybrid,
        help="a hybrid KV cache against every layer kept full, at the same memory",
        description="On an engine with no model and a sliding-window model's shape: the KV a request holds, "
                    "the requests that run at once and vLLM's concurrency figure, with the layers grouped by "
                    "attention kind and with every layer kept full, from the same pool memory.")


def run_hybrid(args: argparse.Namespace) -> int:
    from kvscope.app.bench.hybrid import as_json, format_table, run_hybrid_bench

    settings = _settings(HybridSettings, args)
    rows = run_hybrid_bench(settings)
    print(json.dumps(as_json(rows)) if args.json else format_table(rows, settings))
    return 0


def register_host(subparsers) -> None:
    _add_settings_bench(
        subparsers, "host", HostSettings, run_host,
        help="the host's work in one engine step, by phase, without the forward",
        description="Thread CPU time of each phase of a decode step (schedule, prepare, update, snapshot, "
                    "events, run-log encode) on an engine with no model, for every pool, batch and context "
                    "asked for, and the sampler at each batch over the default model's vocabulary.")


def run_host(args: argparse.Namespace) -> int:
    from kvscope.app.bench.host import as_json, format_table, run_host_bench

    settings = _settings(HostSettings, args)
    try:
        rows, tokenizer_name = run_host_bench(settings, progress=_progress)
    except ValueError as exc:      # a cell that does not fit its pool
        raise SystemExit(f"kvscope bench host: {exc}") from None
    print(json.dumps(as_json(rows)) if args.json else format_table(rows, settings, tokenizer_name))
    return 0


def _window_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, like 120x40, got {text!r}") from None
    if width < 40 or height < 12:
        raise argparse.ArgumentTypeError(f"the window needs at least 40x12, got {text}")
    return width, height


def register_ui(subparsers) -> None:
    parser = _add_settings_bench(
        subparsers, "ui", UiSettings, run_ui,
        help="a block-map frame at a big pool, and the open window's cost to engine throughput",
        description="On an engine with no model whose pool is mostly in use: the block map's frame time "
                    "(UI-thread CPU), and engine steps per CPU second headless and with the app open.")
    size = UiSettings().size
    parser.add_argument("--size", type=_window_size, default=size, metavar="WxH",
                        help=f"the window's size in cells (default {size[0]}x{size[1]})")


def run_ui(args: argparse.Namespace) -> int:
    from kvscope.app.bench.ui import as_json, format_table, run_ui_bench

    if args.usage >= 1:
        raise SystemExit(f"kvscope bench ui: --usage is a share below 1, got {args.usage}")
    settings = _settings(UiSettings, args, size=args.size)
    try:
        result = run_ui_bench(settings, progress=_progress)
    except ValueError as exc:
        raise SystemExit(f"kvscope bench ui: {exc}") from None
    print(json.dumps(as_json(result)) if args.json else format_table(result))
    return 0


def register_kernels(subparsers) -> None:
    parser = subparsers.add_parser("kernels", help="one layer's paged attention and bf16 linears per call",
                                   description="Time kvscope's paged attention kernels per call, beside the "
                                               "machine's copy bandwidth and matmul peak, and its bf16 linear "
                                               "beside oneDNN's.")
    add_dtype_flag(parser, "float32,bfloat16")
    add_model_flags(parser, names=("device",))
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    add_repeats_flag(parser, "timed calls per case", 20)
    parser.add_argument("--only", choices=("attention", "linear"), default=None,
                        help="one table: attention or linear (default: both)")
    add_json_flag(parser)
    parser.set_defaults(func=run_kernels, model="default")


def run_kernels(args: argparse.Namespace) -> int:
    from kvscope.app.bench.harness import environment_line
    from kvscope.app.bench.kernels_bench import copy_bandwidth, format_table, run_kernel_bench
    from kvscope.app.bench.options import matmul_peaks

    dtypes = tuple(parse_dtypes(args.dtype, default="float32,bfloat16"))
    device = setup_torch(args)
    print(f"kvscope bench kernels: {environment_line()}", file=sys.stderr)
    if args.only != "linear":
        bandwidth = copy_bandwidth(device)
        peaks = matmul_peaks(device)
        rows = run_kernel_bench(dtypes=dtypes, repeats=args.repeats, device=device, seed=args.seed,
                                progress=None if args.json else _progress, copy_gb_per_s=bandwidth)
        if args.json:
            print("\n".join(json.dumps(row | {"copy_gb_per_s": bandwidth, "matmul_gflops": peaks}) for row in rows))
        else:
            print(format_table(rows, copy_gb_per_s=bandwidth, matmul_gflops=peaks))
    if args.only != "attention" and device == "cpu":
        _run_linear_bench(args)
    return 0


def _run_linear_bench(args: argparse.Namespace) -> None:
    from kvscope.app.bench import linear_bench

    rows = linear_bench.run_linear_bench(repeats=args.repeats, seed=args.seed,
                                         progress=None if args.json else _progress)
    print("\n".join(json.dumps(row) for row in rows) if args.json else linear_bench.format_table(rows))


def register_scheduler(subparsers) -> None:
    parser = subparsers.add_parser("scheduler", help="one step() without the model, with and without text",
                                   description="The median step() of decoding requests on an engine with no "
                                               "model, detokenizing and not.")
    parser.add_argument("--requests", type=positive_int, default=256, help="running requests (default 256)")
    add_json_flag(parser)
    parser.set_defaults(func=run_scheduler)


def run_scheduler(args: argparse.Namespace) -> int:
    from kvscope.app.bench.scheduler import print_scheduler_bench, run_scheduler_bench

    if args.json:
        print(json.dumps({"bench": "scheduler", **run_scheduler_bench(num_requests=args.requests)}))
    else:
        print_scheduler_bench(num_requests=args.requests)
    return 0


def register_attach(subparsers) -> None:
    parser = subparsers.add_parser("attach", help="the vLLM attach client's CPU at an event rate, and its memory",
                                   description="Replay recorded vLLM KV-cache events at a rate through the "
                                               "attach client; its memory for a big pool.")
    parser.add_argument("--rate", type=positive_float, default=10_000,
                        help="events per second to replay (default 10,000)")
    parser.add_argument("--seconds", type=positive_float, default=10.0, help="how long to replay them (default 10)")
    parser.add_argument("--pool-blocks", type=positive_int, default=1_000_000,
                        help="pool size for the memory figure (default 1,000,000)")
    add_json_flag(parser)
    parser.set_defaults(func=run_attach)


def run_attach(args: argparse.Namespace) -> int:
    from kvscope.app.attach.bench import report, run_memory, run_rate

    rate = run_rate(args.rate, args.seconds, args.pool_blocks)
    memory = run_memory(args.pool_blocks)
    if args.json:
        print(json.dumps({"bench": "attach", **dataclasses.asdict(rate),
                          **{f"memory_{k}": v for k, v in dataclasses.asdict(memory).items()}}))
    else:
        print(report(rate, memory))
    return 0


def register_lessons(subparsers) -> None:
    parser = subparsers.add_parser("lessons", help="how long each lesson takes with the real model",
                                   description="Play every lesson in the app, Space pressed as soon as each "
                                               "moment is ready.")
    add_dtype_flag(parser, "the model's own", many=False)
    add_model_flags(parser)
    parser.add_argument("--db", default=None, help="run log SQLite file (default: in the user data dir)")
    parser.add_argument("--no-log", action="store_true", help="do not keep the lessons' runs")
    parser.set_defaults(func=run_lessons)


def run_lessons(args: argparse.Namespace) -> int:
    from kvscope.app.bench.lessons_bench import format_table, time_lessons
    from kvscope.engine.config import EngineConfig

    dtype = parse_dtypes(args.dtype)[0] if args.dtype else "auto"
    setup_torch(args)
    config = EngineConfig(model=args.model, device=args.device, dtype=dtype)
    load_seconds, timings = time_lessons(config, db_path=args.db, log_enabled=not args.no_log)
    print(format_table(load_seconds, timings))
    return 0


def register_startup(subparsers) -> None:
    parser = subparsers.add_parser("startup", help="a fresh process's time until the engine is ready, and its peak "
                                                   "memory", description="Start fresh processes that import "
                                                                         "kvscope and build the default engine.")
    add_dtype_flag(parser, "bfloat16", many=False)
    add_model_flags(parser)
    add_repeats_flag(parser, "fresh processes", 3)
    parser.set_defaults(func=run_startup)


def run_startup(args: argparse.Namespace) -> int:
    from kvscope.app.bench.startup_bench import format_table, time_startups

    dtype = parse_dtypes(args.dtype, "bfloat16")[0]
    print(format_table(time_startups(args.model, args.device, dtype, args.threads, args.repeats), dtype))
    return 0
