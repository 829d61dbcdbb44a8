"""`make bench-vllm` runs vLLM when started from the repository root, as the Makefile starts it.

A Python started in the checkout has it on sys.path, and transformers then takes our kernels/ folder for
Hugging Face's `kernels` package: vLLM's model-inspection child failed with "No module named 'kvscope'" and
every vLLM row read "not run". The bench starts vLLM outside the checkout; this runs the bench's vLLM system
exactly as `make bench-vllm` does (the venv's `kvscope`, the root as working directory, the vLLM interpreter
named relative to it), on a few requests, and reads its row: it ran, and it carries its accuracy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1800   # vLLM's first start compiles its model


def test_the_bench_runs_vllm_from_the_repository_root():
    kvscope = Path(sys.executable).parent / "kvscope"
    vllm_python = os.path.relpath(os.environ["KVSCOPE_VLLM_PYTHON"], REPOSITORY)
    command = [str(kvscope), "bench", "throughput", "--workload", "mixed", "--requests", "3", "--dtype", "bfloat16",
               "--systems", "vllm", "--vllm-python", vllm_python, "--threads", "2", "--json", "--no-log",
               "--no-floor"]
    result = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    [row] = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert row["system"] == "vllm" and row.get("not_run") is None, row.get("not_run")
    assert row["output_tokens_per_s"] > 0 and row["load_s"] > 0
    assert row["accuracy_sample"] == 3 and row["first_token_agreement"] is not None
    assert 0 <= row["equal_alone"] <= 3
