"""vLLM as a bench system: the same workload through vLLM's offline ``LLM.generate``, in vLLM's own venv.

vLLM pins an older transformers than kvscope, so it cannot share this process: the bench writes the workload
as JSON, runs ``vllm_runner.py`` with vLLM's interpreter and reads the result back. vLLM gets the same number of
compute threads as every other system (bound to cores 0..n-1, none reserved for its front end), the same model
directory, dtype, max_model_len and KV budget, and its own defaults for everything else (block size, batch
limits, torch.compile). Its load and compile time is reported apart from the timed run. It returns each request's
tokens, and those of the accuracy sample run alone afterwards, so its row carries the accuracy columns too.

The interpreter is ``--vllm-python``, else ``.venv-vllm/bin/python`` in the working directory or the repository
(``make bench-vllm`` creates it). Without one, the vllm row says how to get it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvscope.app.bench.accuracy import Sample
from kvscope.app.bench.metrics import RunRecord
from kvscope.app.bench.systems import VLLM
from kvscope.app.bench.workloads import BenchRequest, Workload

SYSTEM = VLLM
RUNNER = Path(__file__).with_name("vllm_runner.py")
VENV = ".venv-vllm"
HOW_TO_GET = f"run `make bench-vllm` (it creates {VENV}), or pass --vllm-python PATH"
_REPOSITORY = Path(__file__).resolve().parents[2]
_LOG_TAIL_LINES = 15


class SystemUnavailable(RuntimeError):
    """A system cannot run here; the message says why and how to fix it."""


@dataclass(frozen=True)
class VllmSettings:
    python: str | None = None       # vLLM's interpreter; None: look for .venv-vllm
    timeout_s: float = 4 * 3600


def find_python(explicit: str | None) -> Path:
    if explicit:
        path = Path(explicit).expanduser().absolute()   # absolute, not resolved: a venv's python is a link
        if not path.is_file():
            raise SystemUnavailable(f"--vllm-python {explicit} does not exist; {HOW_TO_GET}")
        return path
    for root in (Path.cwd(), _REPOSITORY):
        candidate = root / VENV / "bin" / "python"
        if candidate.is_file():
            return candidate
    raise SystemUnavailable(f"vLLM is not installed: {HOW_TO_GET}")


def thread_environment(threads: int) -> dict[str, str]:
    """vLLM's compute threads bound to cores 0..threads-1, none reserved for the front end; offline only."""
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _request(request: BenchRequest, seed: int | None = None) -> dict:
    return {"prompt_token_ids": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
            "n": request.n, "seed": seed}


def build_job(workload: Workload, warm_up: BenchRequest, *, model_dir: str, dtype: str,
              enable_prefix_caching: bool = True, block_size: int | None = None,
              max_num_batched_tokens: int | None = None, alone: Sample | None = None) -> dict:
    """The runner's job; block_size and max_num_batched_tokens None leave vLLM's own defaults; ``alone``: the
    requests to run once more, each by itself, after the timed run."""
    return {"model": model_dir, "dtype": dtype, "max_model_len": workload.max_model_len,
            "block_size": block_size, "max_num_batched_tokens": max_num_batched_tokens,
            "kv_cache_tokens": workload.kv_cache_tokens, "temperature": workload.temperature,
            "enable_prefix_caching": enable_prefix_caching, "warm_up": _request(warm_up, seed=0),
            "requests": [_request(r, seed=i) for i, r in enumerate(workload.requests)],
            "alone": [] if alone is None else [{"index": i, "max_tokens": n}
                                               for i, n in zip(alone.indices, alone.tokens, strict=True)]}


def record_from_result(result: dict, workload: Workload, threads: int) -> RunRecord:
    """The RunRecord of a runner result: each token's time where the runner stepped the engine itself, else
    (an older runner) each request's time to first token only, and no inter-token latency."""
    outputs = result["outputs"]
    return RunRecord(
        system=SYSTEM, settings={"vllm": result["vllm_version"], "threads": threads, **result["settings"]},
        wall_s=result["wall_s"], num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=sum(sum(o["num_tokens"]) for o in outputs),
        token_times=[o["token_times"] if o.get("token_times") else [o["ttft_s"]] if o["ttft_s"] is not None else []
                     for o in outputs],
        peak_rss_mb=result["peak_rss_mb"], extra={"load_s": result["load_s"]},
        outputs=[tuple(o["token_ids"]) for o in outputs] if all("token_ids" in o for o in outputs) else None,
        alone_outputs={int(i): tokens for i, tokens in result["alone"].items()} if "alone" in result else None,
    )


def _every_core() -> None:
    """In the child before exec: every core again. kvscope's engine pins the thread that built it
    (engine/model/threads.py), and a child inherits that thread's single core; vLLM then binds its own threads as it
    is told."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


class VllmRun:
    """One pass of a workload through vLLM in a subprocess; ``run()`` returns its RunRecord."""

    def __init__(self, model_dir: str, dtype: str, threads: int, settings: VllmSettings,
                 block_size: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        # vLLM runs elsewhere (see _execute): a local directory is named absolutely.
        self.model_dir = str(Path(model_dir).resolve()) if Path(model_dir).exists() else model_dir
        self.dtype = dtype
        self.threads = threads
        self.settings = settings
        self.engine_settings = {"block_size": block_size, "max_num_batched_tokens": max_num_batched_tokens}

    def run(self, workload: Workload, warm_up: BenchRequest, alone: Sample | None = None) -> RunRecord:
        python = find_python(self.settings.python)
        job = build_job(workload, warm_up, model_dir=self.model_dir, dtype=self.dtype, alone=alone,
                        **self.engine_settings)
        with tempfile.TemporaryDirectory(prefix="kvscope-vllm-") as scratch:
            job_path, result_path, log_path = (Path(scratch) / name for name in ("job.json", "result.json", "log"))
            job_path.write_text(json.dumps(job))
            self._execute(python, Path(scratch), job_path, result_path, log_path)
            result = json.loads(result_path.read_text())
        return record_from_result(result, workload, self.threads)

    def _execute(self, python: Path, scratch: Path, job_path: Path, result_path: Path, log_path: Path) -> None:
        """Run the runner in ``scratch``, a directory outside the checkout, as vLLM's processes' working
        directory and the runner's own: a Python started in the checkout has it on sys.path, and vLLM's
        model-inspection child would then import our kernels/ as Hugging Face's ``kernels`` package."""
        print(f"  vllm: {python} (loading and compiling takes minutes on a first start)", file=sys.stderr,
              flush=True)
        env = os.environ | thread_environment(self.threads)
        runner = shutil.copy(RUNNER, scratch / RUNNER.name)   # a script's own folder goes on sys.path too
        with open(log_path, "w") as log:
            try:
                completed = subprocess.run([str(python), str(runner), str(job_path), str(result_path)], env=env,
                                           cwd=scratch, stdout=log, stderr=subprocess.STDOUT,
                                           timeout=self.settings.timeout_s, check=False, preexec_fn=_every_core)
            except subprocess.TimeoutExpired as exc:
                raise SystemUnavailable(f"vLLM did not finish within {self.settings.timeout_s:.0f} s") from exc
        if completed.returncode != 0 or not result_path.exists():
            tail = log_path.read_text(errors="replace").strip().splitlines()[-_LOG_TAIL_LINES:]
            print("\n".join(f"  vllm| {line}" for line in tail), file=sys.stderr)
            last = tail[-1] if tail else "no output"
            raise SystemUnavailable(f"vLLM failed (exit {completed.returncode}): {last[:160]}")
