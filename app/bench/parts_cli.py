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
    add_bench,
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


def _settings(settings: type, args: argparse.Namespace):
    """``settings`` made from the flags: _add_setting_flags' and any other its fields have (ui's --size)."""
    return settings(**{spec.name: getattr(args, spec.name) for spec in dataclasses.fields(settings)
                       if hasattr(args, spec.name)})


def _add_settings_bench(subparsers, name: str, settings: type, run) -> argparse.ArgumentParser:
    """The subcommand ``name``: a flag per field of ``settings`` that has help text, and --json; its help is the
    first line of ``settings``' docstring and its description the rest.

    ``run(settings)`` returns the rows --json prints and the table printed otherwise; a ValueError it raises (a cell
    that does not fit its pool, a share that is not one) is one line naming the bench."""
    def run_bench(args: argparse.Namespace) -> int:
        try:
            rows, table = run(_settings(settings, args))
        except ValueError as exc:
            raise SystemExit(f"kvscope bench {name}: {exc}") from None
        print(json.dumps(rows) if args.json else table)
        return 0

    parser = add_bench(subparsers, name, run_bench, doc=settings.__doc__)
    _add_setting_flags(parser, settings)
    add_json_flag(parser)
    return parser


def register_hybrid(subparsers) -> None:
    _add_settings_bench(subparsers, "hybrid", HybridSettings, _run_hybrid)


def _run_hybrid(settings: HybridSettings) -> tuple[list[dict], str]:
    from kvscope.app.bench.hybrid import as_json, format_table, run_hybrid_bench

    rows = run_hybrid_bench(settings)
    return as_json(rows), format_table(rows, settings)


def register_host(subparsers) -> None:
    _add_settings_bench(subparsers, "host", HostSettings, _run_host)


def _run_host(settings: HostSettings) -> tuple[list[dict], str]:
    from kvscope.app.bench.host import as_json, format_table, run_host_bench

    rows, tokenizer_name = run_host_bench(settings, progress=_progress)
    return as_json(rows), format_table(rows, settings, tokenizer_name)


def _window_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, like 120x40, got {text!r}") from None
    if width < 40 or height < 12:
        raise argparse.ArgumentTypeError(f"the window needs at least 40x12, got {text}")
    return width, height


def register_ui(subparsers) -> None:
    parser = _add_settings_bench(subparsers, "ui", UiSettings, _run_ui)
    size = UiSettings().size
    parser.add_argument("--size", type=_window_size, default=size, metavar="WxH",
                        help=f"the window's size in cells (default {size[0]}x{size[1]})")


def _run_ui(settings: UiSettings) -> tuple[dict, str]:
    from kvscope.app.bench.ui import as_json, format_table, run_ui_bench

    if settings.usage >= 1:
        raise ValueError(f"--usage is a share below 1, got {settings.usage}")
    result = run_ui_bench(settings, progress=_progress)
    return as_json(result), format_table(result)


def register_kernels(subparsers) -> None:
    parser = add_bench(subparsers, "kernels", run_kernels)
    add_dtype_flag(parser, "float32,bfloat16")
    add_model_flags(parser, names=("device",))
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    add_repeats_flag(parser, "timed calls per case", 20)
    parser.add_argument("--only", choices=("attention", "linear"), default=None,
                        help="one table: attention or linear (default: both)")
    add_json_flag(parser)
    parser.set_defaults(model="default")


def run_kernels(args: argparse.Namespace) -> int:
    """one layer's paged attention and bf16 linears per call

    Time kvscope's paged attention kernels per call, beside the machine's copy bandwidth and matmul peak, and its
    bf16 linear beside oneDNN's."""
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
    parser = add_bench(subparsers, "scheduler", run_scheduler)
    parser.add_argument("--requests", type=positive_int, default=256, help="running requests (default 256)")
    add_json_flag(parser)


def run_scheduler(args: argparse.Namespace) -> int:
    """one step() without the model, with and without text

    The median step() of decoding requests on an engine with no model, detokenizing and not."""
    from kvscope.app.bench.scheduler import print_scheduler_bench, run_scheduler_bench

    if args.json:
        print(json.dumps({"bench": "scheduler", **run_scheduler_bench(num_requests=args.requests)}))
    else:
        print_scheduler_bench(num_requests=args.requests)
    return 0


def register_attach(subparsers) -> None:
    parser = add_bench(subparsers, "attach", run_attach)
    parser.add_argument("--rate", type=positive_float, default=10_000,
                        help="events per second to replay (default 10,000)")
    parser.add_argument("--seconds", type=positive_float, default=10.0, help="how long to replay them (default 10)")
    parser.add_argument("--pool-blocks", type=positive_int, default=1_000_000,
                        help="pool size for the memory figure (default 1,000,000)")
    add_json_flag(parser)


def run_attach(args: argparse.Namespace) -> int:
    """the vLLM attach client's CPU at an event rate, and its memory

    Replay recorded vLLM KV-cache events at a rate through the attach client; its memory for a big pool."""
    from kvscope.app.attach.bench import report, run_memory, run_rate

    rate = run_rate(args.rate, args.seconds, args.pool_blocks)
    memory = run_memory(args.pool_blocks)
    if args.json:
        print(json.dumps({"bench": "attach", **dataclasses.asdict(rate),
                          **{f"memory_{k}": v for k, v in dataclasses.asdict(memory).items()}}))
    else:
        print(report(rate, memory))
    return 0


def _add_one_model_bench(subparsers, name: str, run, dtype_default: str) -> argparse.ArgumentParser:
    """A bench of one engine: the model and device flags, --threads, and one --dtype."""
    parser = add_bench(subparsers, name, run)
    add_dtype_flag(parser, dtype_default, many=False)
    add_model_flags(parser)
    return parser


def register_lessons(subparsers) -> None:
    parser = _add_one_model_bench(subparsers, "lessons", run_lessons, "the model's own")
    parser.add_argument("--db", default=None, help="run log SQLite file (default: in the user data dir)")
    parser.add_argument("--no-log", action="store_true", help="do not keep the lessons' runs")


def run_lessons(args: argparse.Namespace) -> int:
    """how long each lesson takes with the real model

    Play every lesson in the app, Space pressed as soon as each moment is ready."""
    from kvscope.app.bench.lessons_bench import format_table, time_lessons
    from kvscope.engine.config import EngineConfig

    dtype = parse_dtypes(args.dtype)[0] if args.dtype else "auto"
    setup_torch(args)
    config = EngineConfig(model=args.model, device=args.device, dtype=dtype)
    load_seconds, timings = time_lessons(config, db_path=args.db, log_enabled=not args.no_log)
    print(format_table(load_seconds, timings))
    return 0


def register_startup(subparsers) -> None:
    parser = _add_one_model_bench(subparsers, "startup", run_startup, "bfloat16")
    add_repeats_flag(parser, "fresh processes", 3)


def run_startup(args: argparse.Namespace) -> int:
    """a fresh process's time until the engine is ready, and its peak memory

    Start fresh processes that import kvscope and build the default engine."""
    from kvscope.app.bench.startup_bench import format_table, time_startups

    dtype = parse_dtypes(args.dtype, "bfloat16")[0]
    print(format_table(time_startups(args.model, args.device, dtype, args.threads, args.repeats), dtype))
    return 0
