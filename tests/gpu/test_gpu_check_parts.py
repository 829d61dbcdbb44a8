"""The GPU check's parts that need no GPU: reading a profiler trace, a decode profile's run on the CPU, the wheels'
unmet requirements, and the check's table on a machine without CUDA."""

from __future__ import annotations

import cuda_checks
import gpu_check
import gpu_wheels
import pytest
import random_models
import step_profile
import torch
from graph_stand_in import graphs_on_cpu, skip_padded_slots

from kvscope.engine.model.loader import load_model


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_a_trace_gives_each_steps_host_time_busy_gpu_time_and_kernels():
    step = step_profile.STEP
    events = [
        # step 1: 0-1000 us on the host; it waits 300 us in a synchronize; kernels 100-400 and 300-600 overlap
        _x("user_annotation", step, 0, 1000), _x("cuda_runtime", "cudaLaunchKernel", 50, 10),
        _x("cuda_runtime", "cudaStreamSynchronize", 650, 300),
        _x("kernel", "gemm", 100, 300), _x("kernel", "attention", 300, 300), _x("gpu_memcpy", "DtoH", 640, 10),
        # step 2: 1200-2000 us; a blocking copy to the host waits 200 us; one kernel; a cpu op that is no wait
        _x("user_annotation", step, 1200, 800), _x("cpu_op", "aten::copy_", 1300, 50),
        _x("cuda_runtime", "cudaMemcpyAsync", 1700, 200), _x("kernel", "gemm", 1250, 400),
        # not a step: ignored
        _x("user_annotation", "something else", 0, 5000), {"ph": "i", "name": "instant", "ts": 10},
    ]
    figures = step_profile.trace_figures(events)
    assert figures.steps == 2
    assert figures.kernels == pytest.approx((2 + 1) / 2)
    assert figures.gpu_busy_ms == pytest.approx((0.5 + 0.01 + 0.4) / 2)
    assert figures.host_ms == pytest.approx(((1.0 - 0.3) + (0.8 - 0.2)) / 2)


def test_a_trace_without_steps_says_so():
    with pytest.raises(ValueError, match="no step"):
        step_profile.trace_figures([_x("kernel", "gemm", 0, 1)])


def test_which_cuda_calls_wait_for_the_gpu():
    for name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cuStreamSynchronize", "cudaMemcpyAsync",
                 "cuMemcpyDtoH_v2"):
        assert step_profile.waits_for_gpu(name), name
    for name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaEventRecord"):
        assert not step_profile.waits_for_gpu(name), name


def test_a_decode_profile_runs_full_decode_steps_on_the_cpu(tmp_path):
    """The check's profile, on the CPU: every measured step decodes the whole batch; no GPU, so no kernels."""
    shape = random_models.SMOLLM2_135M
    folder = random_models.build(shape, tmp_path / "model", **random_models.tiny(shape))
    model, tokenizer = load_model(str(folder), torch.float32, "cpu")
    profile = step_profile.decode_profile(model, tokenizer, 3, device="cpu", dtype="float32", prompt_len=8)
    assert profile.batch == 3 and profile.kernels == 0 and profile.gpu_busy == 0
    assert profile.step_ms > 0 and profile.host_ms > 0
    assert "batch 3" in profile.text()


def test_unmet_requirements_name_what_is_missing_or_out_of_range(tmp_path):
    info = tmp_path / "shipped-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("\n".join([
        "Metadata-Version: 2.1", "Name: shipped", "Version: 1.0",
        "Requires-Dist: packaging>=1", "Requires-Dist: no-such-distribution-anywhere>=2",
        "Requires-Dist: torch<1", "Requires-Dist: rich; extra == 'fancy'",
        'Requires-Dist: pytest; python_version < "3"', ""]))
    unmet = gpu_wheels.unmet_requirements(tmp_path)
    assert unmet == ["shipped needs no-such-distribution-anywhere>=2, missing",
                     f"shipped needs torch<1, found {torch.__version__}"]


def test_without_cuda_the_check_says_so_in_its_table_and_fails(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_check.main([]) == 1
    table = capsys.readouterr().out.split("gpu-check, ")[1]
    assert "environment" in table and "FAILED" in table and "no CUDA GPU" in table
    assert "exact tokens" not in table


def test_a_bench_row_reads_as_speed_ratio_and_accuracy():
    row = {"system": "hf-static", "output_tokens_per_s": 1234.5, "wall_s": 7.0, "paged_ratio": 3.2,
           "itl_p50_s": 0.012, "first_token_agreement": 7, "accuracy_sample": 8, "mean_leading_agreement": 21.5,
           "below_transformers_bf16": True, "engine_overhead": None}
    assert gpu_check._bench_detail(row) == ("1,234 out tok/s, 7.0s, kvscope-paged is 3.20x this, ITL p50 12.0 ms, "
                                            "vs transformers fp32: first 7/8, lead 21.5 (below transformers bf16)")
    assert gpu_check._bench_detail({"not_run": "no vLLM"}) == "not run: no vLLM"


def test_an_outcome_is_a_row_and_a_part_that_raises_is_a_failed_row():
    table = gpu_check.Table()
    table.run("good", "m", lambda: cuda_checks.Outcome(True, "fine"))
    table.run("bad", "m", lambda: 1 / 0)
    assert [row[2] for row in table.rows] == ["ok", "FAILED"]
    assert table.rows[1][3].startswith("ZeroDivisionError") and table.failed


def test_a_failing_bench_runs_again_without_its_last_peer_but_a_timeout_does_not(monkeypatch):
    calls = []

    def bench_rows(folder, systems, device, requests, timeout):
        calls.append(list(systems))
        if "hf-cb" in systems:
            return None, "exit 1: TypeError", False
        return [{"system": name, "output_tokens_per_s": 10.0, "wall_s": 1.0} for name in systems], "", False

    monkeypatch.setattr(gpu_check, "_bench_rows", bench_rows)
    table = gpu_check.Table()
    gpu_check.bench(table, "m", "folder", "cuda", None)
    assert calls == [["kvscope-paged", "hf-static", "hf-cb"], ["kvscope-paged", "hf-static"]]
    assert [(row[0], row[2]) for row in table.rows] == [("bench mixed bf16 hf-cb", "FAILED"),
                                                        ("bench mixed bf16 kvscope-paged", "ok"),
                                                        ("bench mixed bf16 hf-static", "ok")]
    monkeypatch.setattr(gpu_check, "_bench_rows", lambda *args, **kwargs: (None, "timed out", True))
    table = gpu_check.Table()
    gpu_check.bench(table, "m", "folder", "cuda", None)
    assert [(row[0], row[2], row[3]) for row in table.rows] == [
        ("bench mixed bf16 kvscope-paged,hf-static,hf-cb", "FAILED", "timed out")]


def test_the_sampler_part_on_the_cpu_keeps_first_maxima_and_seeded_rows():
    outcome = cuda_checks.sampler_on_device("cpu", batch=64, vocab=4096, repeats=1)
    assert outcome.passed, outcome.text
    assert "greedy" in outcome.text and "t0.7/p0.95" in outcome.text


def test_the_graphs_exactness_part_counts_padded_replays_with_stand_in_graphs(tmp_path, monkeypatch):
    """The check's graphs part on the CPU, over stand-in graphs (tests/support/graph_stand_in.py): the batch
    shrinks through padded buckets and the tokens equal transformers'; with no graphs it fails, saying so."""
    shape = random_models.SMOLLM2_135M
    folder = random_models.build(shape, tmp_path / "model", **random_models.tiny(shape))
    model, tokenizer = load_model(str(folder), torch.float32, "cpu")
    assert not cuda_checks.graphs_exact_tokens(model, tokenizer, requests=3).passed
    graphs_on_cpu(monkeypatch)
    skip_padded_slots(monkeypatch)
    outcome = cuda_checks.graphs_exact_tokens(model, tokenizer, requests=3)
    assert outcome.passed, outcome.text
    assert outcome.text.startswith("3/3 requests token-identical") and "padded" in outcome.text


@pytest.mark.parametrize("only", [None, "graphs"])
def test_only_graphs_runs_what_the_cuda_graphs_must_pass_and_nothing_else(monkeypatch, capsys, only):
    """The parts each mode runs, every part stood in for (the real ones need a GPU): the whole check by default,
    and with --only graphs the graphs' exactness and the decode steps from graphs beside eager."""
    ok = cuda_checks.Outcome(True, "stood in")
    monkeypatch.setattr(gpu_check, "environment", lambda table, site, device: True)
    monkeypatch.setattr(gpu_check, "models", lambda *args: [("small", "a"), ("1B", "b")])
    monkeypatch.setattr(gpu_check, "load_model", lambda *args: (object(), object()))
    monkeypatch.setattr(gpu_check, "_profile", lambda *args: ok)
    monkeypatch.setattr(gpu_check, "bench", lambda table, label, *args: table.add("bench", label, True, ""))
    monkeypatch.setattr(cuda_checks, "free_gpu_memory", lambda: None)
    for part in ("kernels_against_oracle", "sampler_on_device", "exact_tokens", "graphs_exact_tokens",
                 "pool_sizing"):
        monkeypatch.setattr(cuda_checks, part, lambda *args: ok)
    assert gpu_check.main(["--only", only] if only else []) == 0
    table = capsys.readouterr().out.split("gpu-check, ")[1]
    graph_rows = ["exact tokens, decode from CUDA graphs", "decode step, batch 64, graphs",
                  "decode step, batch 64, eager", "decode step, batch 256, graphs", "decode step, batch 256, eager"]
    others = ["Triton kernels vs torch oracle", "sampler on the device", "exact tokens vs transformers",
              "pool from --gpu-memory-utilization", "bench"]
    assert all(row in table for row in graph_rows)
    assert table.count("decode step, batch 64, graphs") == 2     # both models
    assert all((row in table) == (only is None) for row in others), table
