"""`kvscope bench SUBCOMMAND`: every benchmark, each a subcommand with its own flags.

As `vllm bench serve|throughput|latency` do, `kvscope bench host --help` shows host's flags and no other's.
The subcommands that run whole systems on the real model live in systems_cli.py, those that measure one part
in parts_cli.py; BENCHES is the one list of them. Building these parsers imports no torch, transformers or
textual: each subcommand imports what it needs when it runs.
"""

from __future__ import annotations

import argparse

from kvscope.app.bench import parts_cli, systems_cli

BENCHES = (
    systems_cli.register_throughput,    # kvscope against transformers and vLLM, offline
    systems_cli.register_serve,         # kvscope serve against vLLM's server
    systems_cli.register_logging,       # the run log's cost
    systems_cli.register_logprobs,      # what log-probabilities cost
    parts_cli.register_host,            # the host's work per step, by phase
    parts_cli.register_ui,              # the window's
    parts_cli.register_hybrid,          # a hybrid KV cache against every layer full
    parts_cli.register_kernels,
    parts_cli.register_scheduler,
    parts_cli.register_attach,
    parts_cli.register_lessons,
    parts_cli.register_startup,
)


def register(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="measure kvscope: against transformers and vLLM, and each of its parts",
        description="Each benchmark is a subcommand with its own flags (`kvscope bench SUBCOMMAND --help`).")
    benches = bench.add_subparsers(title="benchmarks", metavar="SUBCOMMAND")
    for register_bench in BENCHES:
        register_bench(benches)
    bench.set_defaults(func=lambda args: _list_benches(bench))


def _list_benches(bench: argparse.ArgumentParser) -> int:
    """`kvscope bench` alone: which benchmarks there are."""
    bench.print_help()
    return 2
