"""lm-evaluation-harness scores a local loglikelihood task through kvscope serve exactly as through its own
transformers model: its ``local-completions`` model (token-id prompts, ``echo``, ``logprobs=1``, ``max_tokens=1``)
against a server on the default model in fp32, and its ``hf`` model on the same weights. Accuracy is the same and
every per-choice log-likelihood within 1e-3.

lm-eval lives in its own venv (lock/lm-eval.txt: it pulls datasets, pandas, scikit-learn), which `make test`
builds and names in KVSCOPE_LM_EVAL_PYTHON; the task (tests/app/serve/lm_eval_task) reads a jsonl beside it, so
nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from models import load_smollm2, smollm2_path
from serve_helpers import running_server

from kvscope.engine import EngineConfig, LLMEngine

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "kvscope_capitals"
LM_EVAL_PYTHON = os.environ.get("KVSCOPE_LM_EVAL_PYTHON") or str(
    Path(__file__).parents[3] / ".venv-lm-eval" / "bin" / "python")
TOLERANCE = 1e-3

pytestmark = [pytest.mark.xdist_group("lm-eval"),
              pytest.mark.skipif(not Path(LM_EVAL_PYTHON).exists(),
                                 reason="lm-eval's venv is missing: `make test` builds it (lock/lm-eval.txt)")]


def lm_eval(workdir: Path, name: str, model: str, model_args: str) -> dict[int, dict]:
    """Run lm_eval on the task; its logged samples by doc id. Started in ``workdir``, outside the checkout."""
    output = workdir / name
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([LM_EVAL_PYTHON, "-m", "lm_eval", "--model", model, "--model_args", model_args,
                           "--device", "cpu", "--tasks", TASK, "--include_path", str(workdir), "--log_samples",
                           "--output_path", str(output)],
                          cwd=workdir, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = output.glob(f"*/samples_{TASK}_*.jsonl")
    return {sample["doc_id"]: sample for sample in map(json.loads, samples.read_text().splitlines())}


def test_local_completions_scores_as_lm_evals_own_hf_model(tmp_path):
    task = (TASK_DIR / f"{TASK.removeprefix('kvscope_')}.yaml.in").read_text()
    (tmp_path / "task.yaml").write_text(task.replace("DATA_FILE", str(TASK_DIR / "capitals.jsonl")))
    weights = smollm2_path()
    expected = lm_eval(tmp_path, "hf", "hf", f"pretrained={weights},dtype=float32")
    model, tok = load_smollm2()
    engine = LLMEngine(EngineConfig(dtype="float32", num_blocks=128, max_model_len=512), model=model, tokenizer=tok)
    with running_server(engine, served_model_name="smollm2") as server:
        served = lm_eval(tmp_path, "served", "local-completions",
                         f"model=smollm2,base_url={server.url}/v1/completions,tokenizer={weights},"
                         "num_concurrent=1,max_retries=1")
    assert sorted(served) == sorted(expected) and len(expected) == 6
    for doc_id, sample in expected.items():
        assert served[doc_id]["acc"] == sample["acc"], doc_id
        for ours, theirs in zip(served[doc_id]["filtered_resps"], sample["filtered_resps"], strict=True):
            assert abs(float(ours[0]) - float(theirs[0])) <= TOLERANCE, (doc_id, ours, theirs)
            assert ours[1] == theirs[1]     # is_greedy
