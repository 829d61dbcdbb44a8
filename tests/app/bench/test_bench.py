"""The bench's workloads, accounting and report, and the kvscope system on the FakeRunner (no model)."""

from __future__ import annotations

import json

import pytest
import torch

from kvscope.app.bench import kernels_bench, linear_bench
from kvscope.app.bench.floor import grid, interpolate
from kvscope.app.bench.hf_static import static_batch_kv_slots, useful_output_tokens
from kvscope.app.bench.kvscope_system import VARIANTS, KvscopeRun, engine_config
from kvscope.app.bench.logging_bench import run_logging_bench
from kvscope.app.bench.metrics import REPORT_KEYS, PeakRss, RunRecord, summarise
from kvscope.app.bench.report import add_ratios, format_table, json_lines
from kvscope.app.bench.systems import CONTIGUOUS, PAGED, PAGED_NO_PREFIX, systems_for
from kvscope.app.bench.workloads import (
    BenchRequest,
    Workload,
    build_workloads,
    mixed,
    parallel_sampling,
    shared_prefix,
    warm_up_request,
)
from kvscope.app.runlog import RunLogReader, record_run
from kvscope.engine.fake_runner import fake_engine
from kvscope.kernels import cpu

# ---- workloads ------------------------------------------------------------------------------------


def test_mixed_workload_reproduces_the_issue_totals():
    workload = mixed(64, seed=0)
    assert len(workload.requests) == 64
    assert workload.num_prompt_tokens == 17_977
    assert workload.num_output_tokens == 9_092
    assert all(16 <= len(r.prompt_token_ids) <= 512 and 16 <= r.max_tokens <= 256 for r in workload.requests)
    assert all(1000 <= t < 40000 for r in workload.requests for t in r.prompt_token_ids)


def test_workloads_are_deterministic_from_their_seed():
    assert mixed(8, seed=3) == mixed(8, seed=3)
    assert mixed(8, seed=3).requests != mixed(8, seed=4).requests


def test_shared_prefix_shares_one_system_prompt():
    workload = shared_prefix(64)
    prefix = workload.requests[0].prompt_token_ids[:512]
    assert all(r.prompt_token_ids[:512] == prefix for r in workload.requests)
    assert all(32 <= len(r.prompt_token_ids) - 512 <= 128 and r.max_tokens == 64 for r in workload.requests)
    assert len({r.prompt_token_ids[512:] for r in workload.requests}) == 64


def test_parallel_sampling_and_overload_shapes():
    sampling = parallel_sampling(16)
    assert len(sampling.requests) == 16 and {r.n for r in sampling.requests} == {4}
    assert sampling.temperature > 0 and sampling.num_sequences == 64
    recompute, swap = build_workloads("overload")
    assert (recompute.name, swap.name) == ("overload-recompute", "overload-swap")
    assert (recompute.preemption_mode, swap.preemption_mode) == ("recompute", "swap")
    assert recompute.kv_cache_tokens == 4 * recompute.max_model_len == 4 * (512 + 256)
    assert len(recompute.requests) == 64
    assert [w.name for w in build_workloads("all", num_requests=2)] == [
        "mixed", "shared-prefix", "parallel-sampling", "overload-recompute", "overload-swap", "chat"]
    with pytest.raises(ValueError, match="unknown workload"):
        build_workloads("nope")


def test_default_systems_per_workload():
    assert systems_for("mixed") == (PAGED, CONTIGUOUS, "hf-static", "hf-cb", "vllm")
    assert PAGED_NO_PREFIX in systems_for("shared-prefix")
    assert systems_for("overload-swap") == (PAGED, CONTIGUOUS)
    assert systems_for("overload-swap", ("hf-cb",)) == ("hf-cb",)


# ---- accounting -----------------------------------------------------------------------------------


def test_static_batch_counts_only_useful_tokens():
    # Two rows padded to 5 prompt slots, run for 4 steps (the longer request's output).
    assert useful_output_tokens([2, 4]) == (6, 8)
    assert useful_output_tokens([2, 4], n=3) == (18, 24)
    used, reserved = static_batch_kv_slots([3, 5], [2, 4])
    assert reserved == 2 * (5 + 6 + 7 + 8)
    assert used == (3 * 4 + 0 + 1 + 2 + 2) + (5 * 4 + 0 + 1 + 2 + 3)


def _record(**overrides) -> RunRecord:
    fields = dict(system="sys", settings={}, wall_s=2.0, num_prompt_tokens=6, num_output_tokens=4,
                  token_times=[[1.0, 2.0, 4.0], [3.0]], batch_sizes=[1, 2, 3], kv_used_slots=30,
                  kv_reserved_slots=40, preemptions=1, prefill_tokens_computed=6, step_s=10.0, forward_s=9.0)
    return RunRecord(**(fields | overrides))


def test_summary_from_known_inputs():
    row = summarise(_record(), "mixed", "float32", 2)
    assert row["output_tokens_per_s"] == 2.0 and row["total_tokens_per_s"] == 5.0
    assert row["mean_batch"] == 2.0 and row["max_batch"] == 3
    assert row["kv_token_utilisation"] == 0.75
    assert row["ttft_p50_s"] == 2.0                      # first tokens at 1 and 3
    assert row["ttft_p99_s"] == pytest.approx(1.0 + 0.99 * 2.0)
    assert row["itl_p50_s"] == 1.5                       # gaps 1 and 2, pooled over requests
    assert row["engine_overhead"] == pytest.approx(0.1)
    assert row["preemptions"] == 1 and row["prefill_tokens_computed"] == 6


def test_summary_reports_null_for_what_a_system_cannot_measure():
    row = summarise(_record(batch_sizes=[], kv_used_slots=None, kv_reserved_slots=None, preemptions=None,
                            prefill_tokens_computed=None, step_s=None, forward_s=None, token_times=[[]]),
                    "mixed", "float32", 1)
    for key in ("mean_batch", "max_batch", "kv_token_utilisation", "ttft_p50_s", "itl_p99_s", "preemptions",
                "prefill_tokens_computed", "engine_overhead"):
        assert row[key] is None


def test_ratios_and_json_lines():
    rows = [summarise(_record(system=name, wall_s=wall), "mixed", "float32", 2)
            for name, wall in ((PAGED, 1.0), ("hf-static", 4.0), ("hf-cb", 2.0))]
    rows.append(summarise(_record(system="hf-cb", wall_s=1.0), "mixed", "bfloat16", 2))  # no paged row there
    add_ratios(rows)
    assert [r["paged_ratio"] for r in rows] == [None, 4.0, 2.0, None]
    lines = [json.loads(line) for line in json_lines(rows).splitlines()]
    assert len(lines) == 4
    for line in lines:
        assert list(line)[:len(REPORT_KEYS)] == list(REPORT_KEYS)
        assert "paged_ratio" in line
    table = format_table(rows, {("mixed", "float32"): ["a note"]})
    assert "mixed · float32" in table and "a note" in table and "4.00x" in table


def test_floor_grid_keeps_extremes_and_interpolates():
    assert grid([5, 1, 3, 3]) == [1, 3, 5]
    many = grid(list(range(1, 2001)), max_points=10)
    assert many[0] == 1 and many[-1] == 2000 and len(many) <= 12
    assert list(interpolate({1: 1.0, 3: 3.0}, [1, 2, 3])) == [1.0, 2.0, 3.0]


def test_peak_rss_is_measured():
    with PeakRss() as rss:
        block = bytearray(64 * 2**20)
        block[::4096] = b"x" * len(block[::4096])
    assert rss.peak_mb is not None and rss.peak_mb >= 64


# ---- the kvscope system on the FakeRunner ---------------------------------------------------------


FAKE_WARM_UP = BenchRequest(tuple(range(40, 48)), 3)  # the FakeRunner's vocabulary is bytes


def _fake_workload(name="tiny", n=1, temperature=0.0, kv_cache_tokens=1024, mode="recompute",
                   lengths=((20, 5), (7, 9), (33, 3), (12, 6))) -> Workload:
    requests = tuple(BenchRequest(tuple(range(10 + i, 10 + i + p)), o, n) for i, (p, o) in enumerate(lengths))
    return Workload(name, requests, max_model_len=64, kv_cache_tokens=kv_cache_tokens,
                    temperature=temperature, preemption_mode=mode)


def _run_fake(system: str, workload: Workload, open_log=None) -> RunRecord:
    config = engine_config(VARIANTS[system], workload, model="fake", device="cpu", dtype="float32")
    warm_up = BenchRequest(FAKE_WARM_UP.prompt_token_ids, FAKE_WARM_UP.max_tokens, workload.requests[0].n)
    return KvscopeRun(VARIANTS[system], fake_engine, open_log).run(workload, warm_up, config)


@pytest.mark.parametrize("system", [PAGED, CONTIGUOUS, PAGED_NO_PREFIX])
def test_kvscope_run_records_every_token(system):
    workload = _fake_workload()
    record = _run_fake(system, workload)
    assert record.num_output_tokens == workload.num_output_tokens
    assert [len(t) for t in record.token_times] == [r.max_tokens for r in workload.requests]
    assert all(t == sorted(t) and t[0] > 0 for t in record.token_times)
    assert record.prefill_tokens_computed == workload.num_prompt_tokens   # nothing cached, nothing preempted
    assert record.preemptions == 0 and max(record.batch_sizes) == 4
    assert 0 < record.kv_used_slots <= record.kv_reserved_slots
    assert record.settings["allocator"] == VARIANTS[system].allocator
    assert sum(rows for _, rows in record.step_shapes) == workload.num_output_tokens


def test_contiguous_reserves_more_than_paged():
    workload = _fake_workload()
    paged, contiguous = _run_fake(PAGED, workload), _run_fake(CONTIGUOUS, workload)
    assert (paged.kv_used_slots / paged.kv_reserved_slots
            > contiguous.kv_used_slots / contiguous.kv_reserved_slots)


def test_parallel_sampling_counts_every_sample():
    workload = _fake_workload(n=3, temperature=0.8)
    record = _run_fake(PAGED, workload)
    asked = sum(r.max_tokens for r in workload.requests)
    assert record.num_output_tokens == workload.num_output_tokens == 3 * asked
    assert [len(t) for t in record.token_times] == [r.max_tokens for r in workload.requests]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_overload_preempts_and_still_finishes(mode):
    # Four requests that each start in one block of 16 and grow into a second; the pool has five.
    workload = _fake_workload(kv_cache_tokens=80, mode=mode, lengths=((14, 10),) * 4)
    record = _run_fake(PAGED, workload)
    assert record.num_output_tokens == workload.num_output_tokens
    assert record.preemptions > 0


def test_kvscope_runs_are_recorded_as_every_run_is(tmp_path):
    db = tmp_path / "runs.db"
    opened = []

    def open_log(engine):
        opened.append(record_run(engine, source="bench", db_path=db))
        return opened[-1]

    workload = _fake_workload()
    _run_fake(PAGED, workload, open_log)
    reader = RunLogReader(db)
    (listed,) = reader.list_runs()
    run = reader.run(listed["id"])
    assert (run["id"], run["source"], run["status"]) == (opened[0].run_id, "bench", "finished")
    requests = reader.rows("requests", run["id"])
    # The warm-up ran before the logger was attached; the prompts are the engine's text for token ids.
    assert [r["prompt_text"] for r in requests] == [bytes(q.prompt_token_ids).decode() for q in workload.requests]
    assert [r["num_prompt_tokens"] for r in requests] == [len(q.prompt_token_ids) for q in workload.requests]
    assert reader.steps(run["id"])[0].num_prefill_tokens > 0
    assert run["config"]["max_model_len"] == workload.max_model_len


def test_logging_bench_reports_ratio_and_database_size(tmp_path):
    db = tmp_path / "runs.db"

    def open_log(engine):
        return record_run(engine, source="bench", db_path=db)

    result = run_logging_bench(fake_engine, open_log, _fake_workload(), db_path=db, model="fake",
                               device="cpu", dtype="float32", warm_up=FAKE_WARM_UP,
                               progress=lambda line: None)
    assert result.runs_per_side == 2 and result.on_off_ratio > 0
    assert result.steps_logged > 0 and result.db_bytes > 0
    assert result.db_bytes_per_1000_steps == pytest.approx(1000 * result.db_bytes / result.steps_logged)
    assert json.loads(json.dumps(result.as_json()))["bench"] == "logging"
    assert "per 1000 steps" in result.text()


def test_warm_up_request_is_small():
    request = warm_up_request(4)
    assert request.n == 4 and len(request.prompt_token_ids) == 32 and request.max_tokens == 8


def test_kernel_bench_reports_decode_and_prefill_per_dtype_and_path():
    shape = kernels_bench.AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    decode = (kernels_bench.DecodeCase(1, 9, 9), kernels_bench.DecodeCase(3, 5, 40))
    prefill = (kernels_bench.PrefillCase(((0, 6), (5, 3))),)
    paths = list(kernels_bench.kernel_paths("cpu"))
    assert paths[-1] == "torch"
    rows = kernels_bench.run_kernel_bench(dtypes=("float32", "bfloat16"), decode_cases=decode, prefill_cases=prefill,
                                          shape=shape, repeats=2, warmup=1, copy_gb_per_s=10.0)
    assert [(r["kernel"], r["dtype"], r["seqs"], r["path"]) for r in rows] == [
        (kernel, dtype, seqs, path) for dtype in ("float32", "bfloat16")
        for kernel, seqs in (("decode", 1), ("decode", 3), ("prefill", 2)) for path in paths]
    assert rows[0]["context_tokens"] == 9 and rows[2 * len(paths)]["query_tokens"] == 9
    assert rows[0]["kv_mib"] * 2**20 == 2 * 9 * 2 * 16 * 4  # keys and values of every context token, fp32
    assert all(r["median_ms"] >= r["min_ms"] > 0 and r["gb_per_s"] > 0 for r in rows)
    assert all(r["of_copy"] == pytest.approx(r["gb_per_s"] / 10.0) for r in rows)
    lines = kernels_bench.format_table(rows, shape, copy_gb_per_s=10.0).splitlines()
    assert "Hq=4 Hkv=2 D=16 block 4" in lines[0] and "GB/s" in lines[1] and "of copy" in lines[1]
    assert [line.split()[:3] for line in lines[2:-1]] == [[r["kernel"], r["path"], r["dtype"]] for r in rows]
    assert lines[-1].startswith("copy bandwidth: 10.0 GB/s")


def test_linear_bench_times_kvscope_beside_onednn_with_each_ones_error():
    rows = linear_bench.run_linear_bench(shapes=((40, 24),), rows=(1, 5), repeats=2, warmup=1)
    paths = list(linear_bench.linear_calls(torch.randn(1, 40), torch.randn(24, 40).bfloat16()))
    assert [(r["rows"], r["path"]) for r in rows] == [(m, path) for m in (1, 5) for path in paths]
    assert all(r["median_ms"] > 0 and r["cpu_ms"] >= 0 for r in rows)
    errors = {r["path"]: r["max_abs_error"] for r in rows}
    # Against the fp32 input's product: vdpbf16ps and oneDNN round the input to bf16; kvscope on AMX (5 rows) takes
    # it as two bf16 parts and keeps fp32 sums, so its error is far below one rounding's.
    if "kvscope" in errors and "oneDNN" in errors:
        assert errors["oneDNN"] > 1e-4 and errors.get("vdpbf16ps", 1) > 1e-4
        if cpu.has_amx():
            assert errors["kvscope"] < 1e-4
    lines = linear_bench.format_table(rows).splitlines()
    assert "x oneDNN" in lines[1] and len(lines) == 3 + len(rows)


def test_copy_bandwidth_is_measured():
    assert kernels_bench.copy_bandwidth(repeats=1) > 0


def test_scheduler_bench_reports_the_engine_share_of_a_step(capsys):
    from kvscope.app.bench.scheduler import print_scheduler_bench

    result = print_scheduler_bench(num_requests=8, num_blocks=256, steps=12, warmup=2)
    assert result["num_requests"] == 8 and result["steps"] == 12
    # The engine's share is the step without the fake forward; both are measured (StepStats), neither assumed.
    assert 0 < result["engine_ms"] <= result["step_wall_ms"] and 0 < result["step_cpu_ms"]
    assert 0 < result["snapshot_ms"] and 0 < result["engine_ms_without_text"]
    parts = ("schedule_ms", "update_ms", "snapshot_ms")
    assert all(0 < result[part] < result["engine_ms"] for part in parts)   # each a strict part of every step
    assert 0 < result["update_ms_without_text"]
    printed = capsys.readouterr().out
    for label in ("the engine: step() - forward", "schedule()", "snapshot", "detokenize=False",
                  "text by the tokenizer"):
        assert label in printed
