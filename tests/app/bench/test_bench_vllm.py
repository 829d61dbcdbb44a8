"""vLLM as a bench system: finding its interpreter, the job it gets, the record it gives, and its failures.

vLLM itself takes minutes to load, so these tests stand a small script in for its interpreter: it reads the job
the bench wrote and answers as ``vllm_runner.py`` would. ``KVSCOPE_VLLM_PYTHON=/path/to/python`` also runs the
real thing on a few requests (minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from models import tiny_model

from kvscope.app.bench import vllm_runner, vllm_system
from kvscope.app.bench.accuracy import Reference, Sample, agreement
from kvscope.app.bench.harness import Bench, BenchOptions
from kvscope.app.bench.report import add_ratios, format_table
from kvscope.app.bench.vllm_system import SystemUnavailable, VllmRun, VllmSettings, find_python
from kvscope.app.bench.workloads import BenchRequest, Workload, mixed, warm_up_request

# Answers as vllm_runner.py does: every request gets its tokens; the environment the bench set is echoed back.
_FAKE_VLLM = """#!{python}
import json, os, sys
runner, job_path, result_path = sys.argv[1:]
job = json.load(open(job_path))
json.dump(job, open(result_path + ".job", "w"))
if job["requests"][0]["max_tokens"] == 13:
    print("boom: the engine core died")
    sys.exit(3)
outputs = [{{"num_tokens": [r["max_tokens"]] * r["n"], "ttft_s": 0.5 + i,
             "token_ids": list(range(i, i + r["max_tokens"]))}} for i, r in enumerate(job["requests"])]
# Alone, request 1 answers differently from its 3rd token on: a batch-dependent system.
alone = {{str(a["index"]): list(range(a["index"], a["index"] + a["max_tokens"])) for a in job["alone"]}}
if "1" in alone:
    alone["1"][2:] = [0] * (len(alone["1"]) - 2)
env = {{k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "HF_HUB_OFFLINE")}}
json.dump({{"vllm_version": "0.0-fake", "load_s": 12.5, "wall_s": 2.0, "peak_rss_mb": 321.0,
           "settings": {{"block_size": 128, **env}}, "outputs": outputs, "alone": alone}}, open(result_path, "w"))
"""


@pytest.fixture
def fake_python(tmp_path) -> Path:
    path = tmp_path / "venv" / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text(_FAKE_VLLM.format(python=sys.executable))
    path.chmod(0o755)
    return path


def _workload(max_tokens: int = 4) -> Workload:
    requests = (BenchRequest((1000, 1001, 1002), max_tokens), BenchRequest(tuple(range(2000, 2009)), 6, n=2))
    return Workload("tiny", requests, max_model_len=64, kv_cache_tokens=512)


def test_the_interpreter_is_found_or_the_row_says_how_to_get_it(tmp_path, monkeypatch, fake_python):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(vllm_system, "_REPOSITORY", tmp_path / "repository")
    with pytest.raises(SystemUnavailable, match="vLLM is not installed: run `make bench-vllm`"):
        find_python(None)
    with pytest.raises(SystemUnavailable, match="--vllm-python /no/such/python does not exist; run `make bench-vllm`"):
        find_python("/no/such/python")
    assert find_python(str(fake_python)) == fake_python
    (tmp_path / ".venv-vllm").symlink_to(fake_python.parent.parent)
    assert find_python(None) == tmp_path / ".venv-vllm" / "bin" / "python"


def test_a_run_sends_the_workload_and_threads_and_reads_the_record_back(tmp_path, fake_python, monkeypatch):
    workload = _workload()
    record = VllmRun("/models/tiny", "bfloat16", 2, VllmSettings(python=str(fake_python))).run(
        workload, warm_up_request())
    assert record.system == "vllm" and record.wall_s == 2.0 and record.extra == {"load_s": 12.5}
    assert record.num_output_tokens == workload.num_output_tokens == 4 + 12
    assert record.token_times == [[0.5], [1.5]] and record.peak_rss_mb == 321.0
    assert record.settings["threads"] == 2 and record.settings["vllm"] == "0.0-fake"
    assert (record.settings["VLLM_CPU_OMP_THREADS_BIND"], record.settings["VLLM_CPU_NUM_OF_RESERVED_CPU"],
            record.settings["HF_HUB_OFFLINE"]) == ("0-1", "0", "1")


def test_the_job_is_the_workload_exactly():
    workload = mixed(5, seed=3)
    job = vllm_system.build_job(workload, warm_up_request(), model_dir="/m", dtype="float32",
                                alone=Sample.of(workload))
    assert [tuple(r["prompt_token_ids"]) for r in job["requests"]] == [r.prompt_token_ids for r in workload.requests]
    assert [r["max_tokens"] for r in job["requests"]] == [r.max_tokens for r in workload.requests]
    assert (job["max_model_len"], job["kv_cache_tokens"], job["dtype"]) == (768, 32768, "float32")
    assert job["alone"] == [{"index": i, "max_tokens": min(32, workload.requests[i].max_tokens)} for i in range(5)]
    assert json.loads(json.dumps(job)) == job


def _bench(model_and_tokenizer, vllm: VllmSettings | None = None) -> Bench:
    options = BenchOptions(model="default", dtype="bfloat16", systems=("vllm",), vllm=vllm or VllmSettings(),
                           forward_floor=False)
    return Bench(*model_and_tokenizer, options, progress=lambda line: None)


def test_a_failing_vllm_is_one_clear_row(fake_python, capsys):
    bench = _bench(tiny_model("llama"), VllmSettings(python=str(fake_python)))
    rows = add_ratios(bench.run([_workload(max_tokens=13)]))
    assert [r["system"] for r in rows] == ["vllm"] and rows[0]["output_tokens_per_s"] is None
    assert rows[0]["not_run"] == "vLLM failed (exit 3): boom: the engine core died"
    assert "vllm: not run: vLLM failed (exit 3)" in format_table(rows, bench.notes)
    assert "vllm| boom: the engine core died" in capsys.readouterr().err


def test_without_a_venv_the_vllm_row_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(vllm_system, "_REPOSITORY", tmp_path)
    bench = _bench(tiny_model("llama"))
    rows = add_ratios(bench.run([_workload()]))
    assert rows[0]["not_run"] == f"vLLM is not installed: {vllm_system.HOW_TO_GET}"
    assert "make bench-vllm" in format_table(rows, bench.notes)


def test_a_vllm_row_reports_its_load_time_apart(fake_python):
    bench = _bench(tiny_model("llama"), VllmSettings(python=str(fake_python)))
    rows = add_ratios(bench.run([_workload()]))
    assert rows[0]["load_s"] == 12.5 and rows[0]["output_tokens_per_s"] == 16 / 2.0
    table = format_table(rows, bench.notes)
    assert "vllm load and compile: 12.5s (outside its timed run)" in table
    header, row = table.splitlines()[1:3]
    assert header.split()[-8:-4] == ["MFU", "load", "paged", "x"] and row.split()[-5:-3] == ["12s", "-"]


def test_vllm_returns_its_tokens_and_runs_the_sample_alone_for_the_accuracy_columns(fake_python):
    workload = _workload()
    sample = Sample.of(workload)
    record = VllmRun("/models/tiny", "bfloat16", 2, VllmSettings(python=str(fake_python))).run(
        workload, warm_up_request(), sample)
    assert record.outputs == [(0, 1, 2, 3), (1, 2, 3, 4, 5, 6)]
    assert record.alone_outputs == {0: [0, 1, 2, 3], 1: [1, 2, 0, 0, 0, 0]}
    reference = Reference(sample, ((0, 1, 9, 9), (1, 2, 3, 4, 5, 6)), agreement([(0, 1), (1,)], [(0, 1), (1, 2)]))
    fields = reference.row_fields(record.outputs, record.alone_outputs)
    assert (fields["first_token_agreement"], fields["mean_leading_agreement"], fields["equal_alone"]) == (2, 4.0, 1)
    assert fields["below_transformers_bf16"] is False     # the bar: first 2/2, lead 1.5


def test_the_runner_counts_the_memory_of_the_processes_it_started():
    """vLLM's engine core is a live child when the runner measures: its peak must be in the figure."""
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 * 2**20); import time; time.sleep(30)"])
    try:
        for _ in range(100):
            if vllm_runner._status_kb(child.pid, "VmHWM:") > 150 * 1024:
                break
            time.sleep(0.05)
        assert child.pid in vllm_runner._children(os.getpid())
        assert vllm_runner._peak_rss_mb() > 200
    finally:
        child.kill()
        child.wait()


def test_the_runner_sizes_vllms_kv_pool_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3,
                                                      "hidden_size": 576, "num_hidden_layers": 30}))
    assert vllm_runner._kv_bytes_per_token(str(tmp_path), "bfloat16") == 2 * 30 * 3 * 64 * 2


@pytest.mark.skipif(not os.environ.get("KVSCOPE_VLLM_PYTHON"), reason="set KVSCOPE_VLLM_PYTHON to run real vLLM")
def test_real_vllm_runs_a_small_workload():
    from kvscope.engine.model.loader import resolve_model_path

    workload = mixed(3, seed=1)
    run = VllmRun(resolve_model_path("default"), "bfloat16", 1, VllmSettings(os.environ["KVSCOPE_VLLM_PYTHON"]))
    record = run.run(workload, warm_up_request())
    assert record.num_output_tokens == workload.num_output_tokens and record.extra["load_s"] > 0
