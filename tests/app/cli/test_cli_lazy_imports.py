"""An engine command needs none of the window's, the server's, the run log's or attach's packages.

An offline GPU machine may hold only torch, triton and transformers: `kvscope bench throughput` and the GPU
check's engine parts must run there. Each case runs in a process where those packages cannot be imported (a
sitecustomize on PYTHONPATH refuses them), started outside the checkout as every child process is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GPU_CHECK = ROOT / "tests" / "gpu"
# Top-level modules of the packages an engine command must not need. (rich and pydantic stay: the lock's
# transformers reaches them itself, through typer.)
HIDDEN = ("textual", "fastapi", "starlette", "uvicorn", "sqlite_utils", "zmq", "msgspec", "httpx",
          "prometheus_client")

REFUSE = textwrap.dedent(f"""
    import importlib.abc, sys

    class _Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {HIDDEN!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
            return None

    sys.meta_path.insert(0, _Absent())
""")


@pytest.fixture(scope="module")
def without_ui_packages(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("absent")
    (folder / "sitecustomize.py").write_text(REFUSE)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(folder)
    return env


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_packages_are_really_hidden(without_ui_packages, tmp_path):
    result = subprocess.run([sys.executable, "-c", "import textual"], env=without_ui_packages, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "hidden by the test" in result.stderr


def test_bench_throughput_runs_on_a_model_folder(without_ui_packages, tmp_path):
    sys.path.insert(0, str(GPU_CHECK))
    import random_models

    model = random_models.build(random_models.SMOLLM2_135M, tmp_path / "model",
                                **random_models.tiny(random_models.SMOLLM2_135M))
    result = _run(["-m", "kvscope", "bench", "throughput", "--model", str(model), "--device", "cpu",
                   "--workload", "mixed", "--requests", "2", "--systems", "kvscope-paged,hf-static",
                   "--dtype", "float32", "--threads", "1", "--no-log", "--no-floor", "--json"],
                  without_ui_packages, tmp_path)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["system"] for row in rows] == ["kvscope-paged", "hf-static"]
    assert all(row["output_tokens_per_s"] > 0 and row["first_token_agreement"] is not None for row in rows)


def test_bench_help_and_the_gpu_checks_engine_parts_import(without_ui_packages, tmp_path):
    assert "--workload" in _run(["-m", "kvscope", "bench", "throughput", "--help"], without_ui_packages,
                                tmp_path).stdout
    probe = "import cuda_checks, random_models, step_profile, gpu_check; print('imported')"
    assert "imported" in _run(["-c", f"import sys; sys.path.insert(0, {str(GPU_CHECK)!r}); {probe}"],
                              without_ui_packages, tmp_path).stdout
