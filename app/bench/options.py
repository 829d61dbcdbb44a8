"""What the bench subcommands share: their argument types, the flags several take, and setting up torch once.

Importing this costs no torch, transformers or textual: every subcommand's parser is built from it at start-up,
and `kvscope bench host --help` must not wait for (or need) any of them.
"""

from __future__ import annotations

import argparse
import inspect

from kvscope.app.flags import add_engine_flags

DTYPES = ("float32", "bfloat16", "float16")


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    return _positive(text, int, "a whole number", lambda value: value >= 1, "be at least 1")


def positive_float(text: str) -> float:
    """argparse type: a number above 0."""
    return _positive(text, float, "a number", lambda value: value > 0, "be above 0")


def _positive(text: str, kind: type, noun: str, holds, rule: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
    if not holds(value):
        raise argparse.ArgumentTypeError(f"must {rule}, got {text}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated whole numbers of at least 1 ("4096,65536")."""
    values = tuple(positive_int(part.strip().replace("_", "")) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}")
    return values


def parse_dtypes(text: str | None, default: str = "float32") -> list[str]:
    text = default if text is None else text
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise SystemExit(f"kvscope bench: --dtype takes {', '.join(DTYPES)} (comma-separated), got {text!r}")
    return dtypes


def add_bench(subparsers, name: str, run, doc: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """The subcommand ``name``, running ``run(args)``. Its help is the first line of ``doc`` (``run``'s docstring
    unless given) and its description the rest: what a bench does is written once, beside what does it."""
    help, _, description = inspect.cleandoc(doc or run.__doc__).partition("\n\n")
    parser = subparsers.add_parser(name, help=help, description=description, **kwargs)
    parser.set_defaults(func=run)
    return parser


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="JSON instead of a table")


def add_dtype_flag(parser: argparse.ArgumentParser, default: str, many: bool = True) -> None:
    listed = "; a comma-separated list runs each in turn" if many else ""
    parser.add_argument("--dtype", default=None, help=f"{', '.join(DTYPES)}{listed} (default: {default})")


def add_model_flags(parser: argparse.ArgumentParser, threads: bool = True, names=("model", "device")) -> None:
    """The model and device flags as every engine command names them, and --threads."""
    add_engine_flags(parser, names=names)
    if threads:
        parser.add_argument("--threads", type=positive_int, default=None,
                            help="torch threads (default: torch's choice)")


def add_repeats_flag(parser: argparse.ArgumentParser, what: str, default: int) -> None:
    parser.add_argument("--repeats", type=positive_int, default=default, help=f"{what} (default {default})")


def setup_torch(args: argparse.Namespace) -> str:
    """Threads and device, decided once for every system; returns the device's type ("cpu", "cuda")."""
    import torch

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.model.model_runner import resolve_device

    EngineConfig(model=args.model, device=args.device)     # a bad --device fails here, in one line
    if args.threads:
        torch.set_num_threads(args.threads)
    return resolve_device(args.device).type


def matmul_peaks(device: str) -> dict[str, float]:
    """The machine's matmul throughput per dtype, on the bench's threads (app/bench/peak.py)."""
    import torch

    from kvscope.app.bench.peak import matmul_peak_gflops

    return {name: matmul_peak_gflops(getattr(torch, name), device=device) for name in ("float32", "bfloat16")}
