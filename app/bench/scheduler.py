"""`kvscope bench scheduler`: the cost of one engine step without the model.

Everything step() does except the forward: scheduling, block bookkeeping,
appending tokens, stop checks, detokenizing, outputs, stats and the snapshot.
The model is the FakeRunner with its KV verification off, so its share is a
few hash mixes per request; it is reported separately all the same. Wall time
is what a user waits; CPU time is the cost itself, and stays honest when other
work shares the cores.
"""

from __future__ import annotations

import random
import statistics
import time

from engine.config import EngineConfig, SamplingParams
from engine.fake_runner import FakeRunner
from engine.llm_engine import LLMEngine

_PROMPT_LEN = 32


def run_scheduler_bench(num_requests: int = 256, num_blocks: int = 4096, steps: int = 150,
                        warmup: int = 20, block_size: int = 16, seed: int = 0) -> dict:
    """Median step() cost with ``num_requests`` running decode requests and ``num_blocks`` blocks."""
    budget = max(2048, num_requests)
    prefill_steps = -(-num_requests * _PROMPT_LEN // budget)
    max_tokens = 2 * prefill_steps + warmup + steps + 2     # nobody finishes while we measure
    peak_blocks = num_requests * -(-(_PROMPT_LEN + max_tokens) // block_size)
    if peak_blocks > num_blocks:
        raise ValueError(f"{num_requests} requests of {_PROMPT_LEN}+{max_tokens} tokens need {peak_blocks} "
                         f"blocks; num_blocks is {num_blocks}: use fewer steps or more blocks")
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=num_requests,
                          max_num_batched_tokens=budget, seed=seed)
    runner = FakeRunner(config, max_model_len=_PROMPT_LEN + max_tokens, verify=False)
    engine = LLMEngine(config, runner=runner)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(num_requests):
        engine.add_request([rng.randrange(256) for _ in range(_PROMPT_LEN)], params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for r in engine.scheduler.running for s in r.seqs):
        engine.step()   # prefill everyone
    for _ in range(warmup):
        engine.step()
    snapshot_times: list[float] = []
    take_snapshot = engine._snapshot

    def timed_snapshot():
        start = time.perf_counter()
        snapshot = take_snapshot()
        snapshot_times.append(time.perf_counter() - start)
        return snapshot

    engine._snapshot = timed_snapshot
    step_times, cpu_times, forward_times = [], [], []
    for _ in range(steps):
        cpu_start = time.thread_time()
        result = engine.step()
        cpu_times.append(time.thread_time() - cpu_start)
        assert result.stats.num_decode_tokens == num_requests and result.stats.num_running == num_requests
        step_times.append(result.stats.duration)
        forward_times.append(result.stats.forward_duration)
    step_ms = statistics.median(step_times) * 1e3
    return {
        "num_requests": num_requests,
        "num_blocks": num_blocks,
        "steps": steps,
        "kv_usage": result.stats.kv_usage,
        "step_ms_median": step_ms,
        "step_ms_p90": statistics.quantiles(step_times, n=10)[-1] * 1e3,
        # CPU time of the stepping thread: the cost itself, even on a machine busy with other work.
        "step_cpu_ms_median": statistics.median(cpu_times) * 1e3,
        "fake_forward_ms_median": statistics.median(forward_times) * 1e3,
        "snapshot_ms_median": statistics.median(snapshot_times) * 1e3,
        "us_per_request": step_ms * 1e3 / num_requests,
    }


def print_scheduler_bench(**kwargs) -> dict:
    result = run_scheduler_bench(**kwargs)
    rows = [
        ("running decode requests", f"{result['num_requests']}"),
        ("blocks (KV usage)", f"{result['num_blocks']} ({result['kv_usage']:.0%})"),
        ("steps measured", f"{result['steps']}"),
        ("step() median", f"{result['step_ms_median']:.3f} ms"),
        ("step() p90", f"{result['step_ms_p90']:.3f} ms"),
        ("step() CPU time median", f"{result['step_cpu_ms_median']:.3f} ms"),
        ("  of which fake forward", f"{result['fake_forward_ms_median']:.3f} ms"),
        ("  of which snapshot", f"{result['snapshot_ms_median']:.3f} ms"),
        ("per request", f"{result['us_per_request']:.2f} us"),
    ]
    width = max(len(name) for name, _ in rows)
    print("kvscope bench scheduler: one step() without the model (FakeRunner, no verification)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>14}")
    return result


if __name__ == "__main__":
    print_scheduler_bench()
