"""`kvscope bench throughput | logging | logprobs | serve`: whole systems on the real model, side by side.

``throughput`` runs kvscope, transformers and vLLM through the same workloads in one process (same model,
dtype, threads, prompts and output lengths); ``logging`` runs kvscope with its run log off and on; ``logprobs``
with log-probabilities asked for none, the sampled tokens or the prompt too; ``serve`` puts kvscope serve and
vLLM's server under the same client at the same request rates. Each registers its own
flags; everything heavy is imported when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
from pathlib import Path

from kvscope.app.bench.options import (
    add_bench,
    add_dtype_flag,
    add_json_flag,
    add_model_flags,
    add_repeats_flag,
    parse_dtypes,
    positive_int,
    setup_torch,
)
from kvscope.app.bench.systems import SYSTEMS
from kvscope.app.bench.workloads import WORKLOAD_NAMES

MATCHED = (128, 4096)   # vLLM 0.32's CPU defaults: block size, max_num_batched_tokens


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="mixed", choices=(*WORKLOAD_NAMES, "all"),
                        help="which workload (default: mixed)")
    parser.add_argument("--requests", type=positive_int, default=None,
                        help="requests per workload (prompts, for parallel-sampling; default: the workload's own)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    add_dtype_flag(parser, "float32")
    add_json_flag(parser)
    add_model_flags(parser)
    parser.add_argument("--db", default=None, help="run log SQLite file (default: in the user data dir)")


def register_throughput(subparsers) -> None:
    parser = add_bench(subparsers, "throughput", run_throughput, aliases=["workloads"])
    _add_workload_flags(parser)
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated, from {','.join(SYSTEMS)} (default: each workload's own set)")
    parser.add_argument("--no-log", action="store_true", help="do not record the kvscope runs in the run log")
    parser.add_argument("--no-floor", action="store_true", help="skip timing the forward-only floor")
    engine = parser.add_argument_group("engine settings for kvscope and vLLM alike (default: each system's own)")
    engine.add_argument("--block-size", type=positive_int, default=None, help="tokens per KV block")
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="token budget of one step")
    engine.add_argument("--cpu-threads-bind", default="none", metavar="CORES",
                        help="kvscope: pin its compute threads, one per core (none, auto, or cores like 0-1)")
    engine.add_argument("--matched", action="store_true",
                        help=f"both at vLLM's CPU defaults: --block-size {MATCHED[0]} --max-num-batched-tokens "
                             f"{MATCHED[1]} (unless those flags say otherwise)")
    peers = parser.add_argument_group("transformers and vLLM")
    peers.add_argument("--hf-batch-size", type=positive_int, default=32,   # StaticSettings' tuned default
                       help="hf-static: requests per static batch")
    peers.add_argument("--hf-cb-max-requests", type=positive_int, default=16, help="hf-cb: most requests per step")
    peers.add_argument("--hf-cb-batch-tokens", type=positive_int, default=512, help="hf-cb: most tokens per step")
    peers.add_argument("--hf-cb-page-size", type=positive_int, default=256, help="hf-cb: tokens per cache page")
    _add_vllm_python_flag(peers)


def register_logging(subparsers) -> None:
    parser = add_bench(subparsers, "logging", run_logging)
    _add_workload_flags(parser)
    add_repeats_flag(parser, "off/on/on/off rounds", 1)


def register_logprobs(subparsers) -> None:
    parser = add_bench(subparsers, "logprobs", run_logprobs)
    _add_random_prompt_flags(parser, "side", requests=16, output_len=32)
    add_dtype_flag(parser, "float32", many=False)
    add_repeats_flag(parser, "none/sampled/prompt/prompt/sampled/none rounds", 1)
    add_json_flag(parser)
    add_model_flags(parser)


def register_serve(subparsers) -> None:
    parser = add_bench(subparsers, "serve", run_serve)
    parser.add_argument("--rates", default="1,4",
                        help="request rates to try, requests/s, comma-separated; inf sends all at once (default 1,4)")
    _add_random_prompt_flags(parser, "rate", requests=32, output_len=64)
    parser.add_argument("--client", default="auto", choices=("auto", "vllm", "openai"),
                        help="vllm: `vllm bench serve` from the vLLM venv; openai: kvscope's own load generator "
                             "(default: vllm when the vLLM venv exists)")
    parser.add_argument("--systems", default="kvscope,vllm", help="kvscope and/or vllm (default: both)")
    add_dtype_flag(parser, "bfloat16", many=False)
    add_json_flag(parser)
    add_model_flags(parser, threads=False, names=("model",))
    _add_vllm_python_flag(parser)


def _add_random_prompt_flags(parser, per: str, requests: int, output_len: int) -> None:
    """How many random prompts, how long, and how long each reply (EOS ignored)."""
    parser.add_argument("--requests", type=positive_int, default=requests,
                        help=f"requests per {per} (default {requests})")
    parser.add_argument("--input-len", type=positive_int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--output-len", type=positive_int, default=output_len,
                        help=f"output tokens (default {output_len})")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed")


def _add_vllm_python_flag(parser) -> None:
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vLLM (default: .venv-vllm/bin/python if it exists; "
                             "`make bench-vllm` creates it)")


def run_serve(args: argparse.Namespace) -> int:
    """kvscope serve against vLLM's server under the same client and request rates

    Start each server in turn and send it the same requests at each rate, with vLLM's own `vllm bench serve` client
    (or kvscope's, without vLLM)."""
    from kvscope.app.bench.serve_bench import ServeBenchSettings, format_table, run_serve_bench
    from kvscope.app.bench.vllm_system import SystemUnavailable, find_python
    from kvscope.engine.model.loader import resolve_model_path

    rates = tuple(float(rate) for rate in args.rates.split(","))
    if not rates or any(not rate > 0 for rate in rates):
        raise SystemExit(f"kvscope bench serve: --rates takes positive numbers or inf, got {args.rates!r}")
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if not systems or set(systems) - {"kvscope", "vllm"}:
        raise SystemExit(f"kvscope bench serve: --systems takes kvscope and/or vllm, got {args.systems!r}")
    try:
        vllm_python = str(find_python(args.vllm_python))
    except SystemUnavailable as exc:
        if args.vllm_python or args.client == "vllm":
            raise SystemExit(f"kvscope bench serve: {exc}") from None
        print(f"kvscope bench serve: {exc}; measuring kvscope only, with kvscope's own client", file=sys.stderr)
        vllm_python, systems = None, tuple(s for s in systems if s != "vllm")
    model_dir = resolve_model_path(args.model)
    settings = ServeBenchSettings(
        model_dir=model_dir, dtype=parse_dtypes(args.dtype, "bfloat16")[0], rates=rates,
        num_prompts=args.requests, input_len=args.input_len, output_len=args.output_len,
        systems=systems, vllm_python=vllm_python, client=args.client, seed=args.seed)
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(model_dir))
    rows, notes = run_serve_bench(settings, vocab_size,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps([dataclasses.asdict(row) for row in rows]) if args.json else format_table(rows, settings, notes))
    return 1 if notes or any(row.failed for row in rows) else 0


def _parse_systems(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    systems = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise SystemExit(f"kvscope bench: unknown system {', '.join(bad) or text!r}; "
                         f"choose from {','.join(SYSTEMS)}")
    return systems


def log_opener(db: str | Path | None):
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


def run_throughput(args: argparse.Namespace) -> int:
    """kvscope against transformers, vLLM and its contiguous baseline on the same workloads

    Run every system side by side in one process: same model, dtype, threads, prompts and output lengths; speed
    beside the accuracy of the same run."""
    from kvscope.app.bench.harness import Bench, BenchOptions, environment_line
    from kvscope.app.bench.hf_cb import ContinuousSettings
    from kvscope.app.bench.hf_static import StaticSettings
    from kvscope.app.bench.options import matmul_peaks
    from kvscope.app.bench.report import add_ratios, format_table, json_lines
    from kvscope.app.bench.vllm_system import VllmSettings
    from kvscope.app.bench.workloads import build_workloads

    dtypes, systems = parse_dtypes(args.dtype), _parse_systems(args.systems)
    workloads = build_workloads(args.workload, args.requests, args.seed)
    device = setup_torch(args)
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
        open_log = None if args.no_log else log_opener(args.db)
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
    """the run log's cost: kvscope with it off and on

    One workload on kvscope, the run log off/on/on/off in each round."""
    from kvscope.app.bench.harness import environment_line
    from kvscope.app.bench.logging_bench import LogUnavailable, run_logging_bench
    from kvscope.app.bench.workloads import build_workloads
    from kvscope.engine import LLMEngine

    dtype = parse_dtypes(args.dtype)[0]
    workload = build_workloads(args.workload, args.requests, args.seed)[0]
    device = setup_torch(args)
    print(f"kvscope bench logging: {environment_line()}", file=sys.stderr)
    model, tokenizer = _load(args, dtype, device)
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as scratch:
        # A fresh database unless --db names one, so its size is this bench's alone.
        db = Path(args.db).expanduser() if args.db else Path(scratch) / "runs.db"
        try:
            result = run_logging_bench(
                lambda config: LLMEngine(config, model=model, tokenizer=tokenizer),
                log_opener(db), workload,
                db_path=db, model=args.model, device=device, dtype=dtype, repeats=args.repeats,
                progress=lambda line: print(line, file=sys.stderr, flush=True))
        except LogUnavailable:  # the opener has printed why
            print("kvscope bench logging: nothing to measure without the run log", file=sys.stderr)
            return 2
    if not args.db:
        result.db_path = "a temporary database, now removed"
    print(json.dumps(result.as_json()) if args.json else result.text())
    return 0


def run_logprobs(args: argparse.Namespace) -> int:
    """what log-probabilities cost: none, the sampled tokens', the prompt's too

    The same greedy requests on one engine three ways, with the prompt log-probabilities checked against
    transformers' log-softmax in the same run."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvscope.app.bench.harness import environment_line
    from kvscope.app.bench.logprobs_bench import random_prompts, run_logprobs_bench
    from kvscope.engine import EngineConfig, LLMEngine
    from kvscope.engine.model.loader import resolve_model_path

    dtype = parse_dtypes(args.dtype)[0]
    device = setup_torch(args)
    print(f"kvscope bench logprobs: {environment_line()}", file=sys.stderr)
    model, tokenizer = _load(args, dtype, device)
    config = EngineConfig(model=args.model, device=device, dtype=dtype, enable_prefix_caching=False,
                          max_model_len=args.input_len + args.output_len)
    engine = LLMEngine(config, model=model, tokenizer=tokenizer)
    prompts = random_prompts(args.requests, args.input_len, len(tokenizer), args.seed)
    reference_model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=torch.float32)

    def reference(prompt_ids: list[int]) -> list[list[float]]:
        with torch.inference_mode():
            logits = reference_model(torch.tensor([prompt_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1).tolist()

    result = run_logprobs_bench(engine, prompts, args.output_len, dtype=dtype, repeats=args.repeats,
                                reference=reference, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(result.as_json()) if args.json else result.text())
    return 0 if all(side.same_tokens for side in result.sides) else 1
