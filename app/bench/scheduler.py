"""`kvscope bench scheduler`: the cost of one engine step without the model.

Everything step() does except the forward: scheduling, block bookkeeping,
appending tokens, stop checks, detokenizing, outputs, stats and the snapshot.
The model is the FakeRunner with its KV verification off, so its share is a
few hash mixes per request; it is timed separately and left out of the
engine's figure. The same run is made twice, with text and with
``detokenize=False``, so detokenizing gets a figure of its own. The text is
the default model's tokenizer once it has been fetched (what a user's chat
costs), else the FakeRunner's byte tokenizer, which is pure Python and slower.
The phases (schedule, the runner's forward, the update that commits tokens and
builds outputs, the snapshot) are the wall-clock timings every step reports in
its StepStats; the bench only reads them. The whole step is also timed in CPU
time of the stepping thread, which stays honest when other work shares the
cores.
"""

from __future__ import annotations

import random
import statistics
import time

from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import FakeRunner
from kvscope.engine.llm_engine import LLMEngine

_PROMPT_LEN = 32


def text_tokenizer():
    """(tokenizer, its name): the default model's when fetched, else None for the FakeRunner's own."""
    from kvscope.engine.model.loader import default_model_dir

    directory = default_model_dir()
    if not (directory / "tokenizer.json").is_file():
        return None, "FakeTokenizer (bytes; no default model fetched)"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory), f"{directory.name}'s"


def _decoding_engine(num_requests: int, num_blocks: int, block_size: int, max_tokens: int, seed: int,
                     detokenize: bool, tokenizer=None) -> LLMEngine:
    """An engine whose ``num_requests`` requests have all finished their prompts and are decoding."""
    budget = max(2048, num_requests)
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=num_requests,
                          max_num_batched_tokens=budget, seed=seed)
    runner = FakeRunner(config, max_model_len=_PROMPT_LEN + max_tokens, verify=False)
    engine = LLMEngine(config, runner=runner, tokenizer=tokenizer)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=detokenize)
    for _ in range(num_requests):
        engine.add_request([rng.randrange(256) for _ in range(_PROMPT_LEN)], params)
    while engine.step().stats.num_prefill_tokens:
        pass    # the last prompt chunks; the step after them is all decodes
    return engine


def _measure(engine: LLMEngine, num_requests: int, steps: int, warmup: int) -> dict:
    """Medians over ``steps`` steps: the whole step in CPU and wall time, and its phases as StepStats reports
    them (wall time; the engine's own share is the step without the fake forward)."""
    for _ in range(warmup):
        engine.step()
    cpu, stats = [], []
    for _ in range(steps):
        start = time.thread_time()
        result = engine.step()
        cpu.append(time.thread_time() - start)
        stats.append(result.stats)
        assert result.stats.num_decode_tokens == num_requests and result.stats.num_running == num_requests
    engine_ms = [(s.duration - s.forward_duration) * 1e3 for s in stats]
    phases = {"forward": "forward_duration", "schedule": "schedule_duration", "update": "update_duration",
              "snapshot": "snapshot_duration"}
    return {
        "kv_usage": stats[-1].kv_usage,
        "step_wall_ms": statistics.median(s.duration for s in stats) * 1e3,
        "step_cpu_ms": statistics.median(cpu) * 1e3,
        "engine_ms": statistics.median(engine_ms),
        "engine_ms_p90": statistics.quantiles(engine_ms, n=10)[-1],
        **{f"{name}_ms": statistics.median(getattr(s, field) for s in stats) * 1e3
           for name, field in phases.items()},
    }


def run_scheduler_bench(num_requests: int = 256, num_blocks: int = 4096, steps: int = 150,
                        warmup: int = 20, block_size: int = 16, seed: int = 0) -> dict:
    """Median step() cost with ``num_requests`` running decode requests and ``num_blocks`` blocks."""
    prefill_steps = -(-num_requests * _PROMPT_LEN // max(2048, num_requests))
    max_tokens = 2 * prefill_steps + warmup + steps + 2     # nobody finishes while we measure
    peak_blocks = num_requests * -(-(_PROMPT_LEN + max_tokens) // block_size)
    if peak_blocks > num_blocks:
        raise ValueError(f"{num_requests} requests of {_PROMPT_LEN}+{max_tokens} tokens need {peak_blocks} "
                         f"blocks; num_blocks is {num_blocks}: use fewer steps or more blocks")
    tokenizer, tokenizer_name = text_tokenizer()
    runs = {}
    for detokenize in (True, False):
        engine = _decoding_engine(num_requests, num_blocks, block_size, max_tokens, seed, detokenize, tokenizer)
        runs[detokenize] = _measure(engine, num_requests, steps, warmup)
    text, ids = runs[True], runs[False]
    return {
        "num_requests": num_requests,
        "num_blocks": num_blocks,
        "steps": steps,
        "tokenizer": tokenizer_name,
        **text,
        "engine_ms_without_text": ids["engine_ms"],
        "update_ms_without_text": ids["update_ms"],
        "snapshot_share": text["snapshot_ms"] / text["engine_ms"],
        "us_per_request": text["engine_ms"] * 1e3 / num_requests,
    }


def print_scheduler_bench(**kwargs) -> dict:
    result = run_scheduler_bench(**kwargs)
    rows = [
        ("running decode requests", f"{result['num_requests']}"),
        ("blocks (KV usage)", f"{result['num_blocks']} ({result['kv_usage']:.0%})"),
        ("steps measured", f"{result['steps']}"),
        ("text by the tokenizer", result["tokenizer"]),
        ("step() CPU, median", f"{result['step_cpu_ms']:.3f} ms"),
        ("step() wall, median", f"{result['step_wall_ms']:.3f} ms"),
        ("  the fake model's forward", f"{result['forward_ms']:.3f} ms"),
        ("  the engine: step() - forward", f"{result['engine_ms']:.3f} ms"),
        ("    p90", f"{result['engine_ms_p90']:.3f} ms"),
        ("    per request", f"{result['us_per_request']:.2f} us"),
        ("    schedule()", f"{result['schedule_ms']:.3f} ms"),
        ("    update: tokens, stops, text, outputs", f"{result['update_ms']:.3f} ms"),
        ("      the same, detokenize=False", f"{result['update_ms_without_text']:.3f} ms"),
        ("    snapshot and stats", f"{result['snapshot_ms']:.3f} ms ({result['snapshot_share']:.0%})"),
        ("  the engine, detokenize=False", f"{result['engine_ms_without_text']:.3f} ms"),
    ]
    width = max(len(name) for name, _ in rows)
    print("kvscope bench scheduler: one step() without the model (FakeRunner, no verification); "
          "phases from StepStats, wall time")
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>16}")
    return result


if __name__ == "__main__":
    print_scheduler_bench()
