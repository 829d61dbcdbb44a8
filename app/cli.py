"""The `kvscope` command line. Flags are named as vLLM names them."""

from __future__ import annotations

import argparse
import sys

from kvscope import __version__
from kvscope.engine.config import ConfigError, EngineConfig, RequestError
from kvscope.engine.loader import ModelError

USER_ERRORS = (ConfigError, RequestError, ModelError)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="default",
                       help="'default' (SmolLM2-135M-Instruct), a transformers model directory, a .gguf file, "
                            "or a hub id when you have network")
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="auto: bf16 on CUDA and on CPUs with native bf16 (AMX/AVX512-BF16), else fp32")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (power of two, 1-256)")
    group.add_argument("--num-blocks", type=int, default=None,
                       help="KV pool size in blocks; overrides --kv-cache-memory and --gpu-memory-utilization")
    group.add_argument("--kv-cache-memory", default=None,
                       help="CPU KV pool size, e.g. 512MiB (default: 10%% of RAM, at most 2GiB)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                       help="fraction of GPU memory for weights, activations and the KV pool")
    group.add_argument("--swap-space", default="1GiB", help="host pool for swap-mode preemption")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt plus output, in tokens (default: the model's limit)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse KV blocks of identical prompt prefixes")
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                       help="what happens to a request pushed out when blocks run short")
    group.add_argument("--allocator", default="paged", choices=["paged", "contiguous"],
                       help="contiguous reserves max_model_len per request: the pre-paging baseline")
    group.add_argument("--seed", type=int, default=0)


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=None, help="run log SQLite file (default: in the user data dir)")
    parser.add_argument("--no-log", action="store_true", help="do not log this run")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, swap_space=args.swap_space,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode, allocator=args.allocator, seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope",
        description="Watch a real paged-attention LLM engine work. With no subcommand, opens the app.",
    )
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    add_engine_flags(parser)
    add_log_flags(parser)
    parser.set_defaults(func=_open_app)
    sub = parser.add_subparsers(title="subcommands", metavar="COMMAND")

    fetch = sub.add_parser("fetch-model", help="install and convert the default model (SmolLM2-135M-Instruct)")
    fetch.set_defaults(func=_fetch_model)

    chat = sub.add_parser("chat", help="answer one prompt in the terminal, streaming, without the app")
    chat.add_argument("prompt", help="the user message")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    add_engine_flags(chat)
    add_log_flags(chat)
    chat.set_defaults(func=_chat)

    for module in ("kvscope.app.bench.cli", "kvscope.app.runs_cli", "kvscope.app.screenshots",
                   "kvscope.app.attach.cli"):
        __import__(module, fromlist=["register"]).register(sub)
    return parser


def _open_app(args: argparse.Namespace) -> int:
    from kvscope.app.tui import run_app

    return run_app(config_from_args(args), db_path=args.db, log_enabled=not args.no_log)


def _fetch_model(args: argparse.Namespace) -> int:
    from kvscope.engine.loader import fetch_default_model

    path = fetch_default_model()
    print(f"default model ready at {path}")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from kvscope.app.runlog import record_run
    from kvscope.engine import LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    params.validate()   # a bad flag fails before the model loads
    engine = LLMEngine(config_from_args(args))
    print(engine.banner, file=sys.stderr)
    with record_run(engine, source="chat", db_path=args.db, enabled=not args.no_log) as log:
        if log.warning:
            print(f"kvscope: {log.warning}", file=sys.stderr)
        engine.add_request([{"role": "user", "content": args.prompt}], params)
        while engine.has_unfinished_requests():
            for output in engine.step().outputs:
                print(output.text_delta, end="", flush=True)
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"kvscope: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
