"""Runs one bench workload through vLLM's offline ``LLM.generate``; executed by vLLM's own interpreter.

vLLM pins an older transformers than kvscope, so it lives in its own venv and this file runs there as a
script: it imports nothing from kvscope (only the standard library and vllm). ``kvscope bench`` writes the job
as JSON (model directory, dtype, threads, the requests as token ids) and reads the result back as JSON from the
path given on the command line. Thread binding is set by the caller in the environment, before vLLM starts.

    python vllm_runner.py JOB.json RESULT.json
"""

from __future__ import annotations

import glob
import json
import os
import resource
import sys
import time

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    with open(f"{model_dir}/config.json") as handle:
        config = json.load(handle)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def _params(vllm, request: dict, temperature: float):
    return vllm.SamplingParams(n=request["n"], max_tokens=request["max_tokens"], min_tokens=request["max_tokens"],
                               temperature=temperature, seed=request.get("seed") if temperature > 0 else None,
                               ignore_eos=True, detokenize=False)


def _generate(llm, vllm, requests: list[dict], temperature: float):
    prompts = [vllm.TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    return llm.generate(prompts, [_params(vllm, r, temperature) for r in requests], use_tqdm=False)


def _stepped(llm, vllm, requests: list[dict], temperature: float, begin: float):
    """The requests through vLLM's engine, stepped here so that each token's time is known (as kvscope's bench
    records its own): (the final outputs in request order, per request the seconds since ``begin`` of each
    token of its first sample)."""
    engine = llm.llm_engine
    ids = [str(i) for i in range(len(requests))]
    for request_id, request in zip(ids, requests):
        engine.add_request(request_id, vllm.TokensPrompt(prompt_token_ids=request["prompt_token_ids"]),
                           _params(vllm, request, temperature))
    finals, times, seen = {}, {request_id: [] for request_id in ids}, dict.fromkeys(ids, 0)
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter() - begin
            count = len(output.outputs[0].token_ids)
            times[output.request_id].extend([now] * (count - seen[output.request_id]))
            seen[output.request_id] = count
            if output.finished:
                finals[output.request_id] = output
    return [finals[request_id] for request_id in ids], [times[request_id] for request_id in ids]


def _ttft(output) -> float | None:
    metrics = getattr(output, "metrics", None)
    latency = getattr(metrics, "first_token_latency", None)
    return latency if latency else None


def _peak_rss_mb() -> float:
    """The peak resident memory of this process and every process under it (vLLM's engine core runs in a
    child, still alive here, so RUSAGE_CHILDREN would miss it), in MiB: the sum of each one's VmHWM."""
    total_kb, pending = 0, [os.getpid()]
    while pending:
        pid = pending.pop()
        total_kb += _status_kb(pid, "VmHWM:")
        pending.extend(_children(pid))
    return total_kb / 1024 or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith(field)), 0)
    except OSError:  # not Linux, or the process has just exited
        return 0


def _children(pid: int) -> list[int]:
    children = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(task) as handle:
                children.extend(int(child) for child in handle.read().split())
        except OSError:
            continue
    return children


def run(job: dict) -> dict:
    start = time.perf_counter()
    import vllm

    settings = {"max_model_len": job["max_model_len"], "enable_prefix_caching": job["enable_prefix_caching"],
                "kv_cache_memory_bytes": job["kv_cache_tokens"] * _kv_bytes_per_token(job["model"], job["dtype"])}
    settings |= {key: job[key] for key in ("block_size", "max_num_batched_tokens") if job.get(key)}
    llm = vllm.LLM(model=job["model"], tokenizer=job["model"], dtype=job["dtype"], seed=0,
                   disable_log_stats=False, **settings)
    load_s = time.perf_counter() - start
    _generate(llm, vllm, [job["warm_up"]], job["temperature"])
    begin = time.perf_counter()
    outputs, token_times = _stepped(llm, vllm, job["requests"], job["temperature"], begin)
    wall_s = time.perf_counter() - begin
    config = llm.llm_engine.vllm_config
    settings |= {"block_size": config.cache_config.block_size,
                 "max_num_seqs": config.scheduler_config.max_num_seqs,
                 "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens}
    return {
        "vllm_version": vllm.__version__, "load_s": load_s, "wall_s": wall_s, "settings": settings,
        "outputs": [{"num_tokens": [len(c.token_ids) for c in o.outputs], "ttft_s": _ttft(o), "token_times": times}
                    for o, times in zip(outputs, token_times)],
        "peak_rss_mb": _peak_rss_mb(),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as handle:
        job = json.load(handle)
    result = run(job)
    with open(argv[2], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
