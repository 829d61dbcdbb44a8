"""The bench's systems on a tiny random-weight model: transformers' peers, the real engine, the CLI."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch
from models import tiny_model

from kvscope.app.bench.accuracy import build_reference, equal_alone
from kvscope.app.bench.harness import Bench, BenchOptions
from kvscope.app.bench.hf_cb import ContinuousBatchRun, ContinuousSettings
from kvscope.app.bench.hf_static import StaticBatchRun, StaticSettings
from kvscope.app.bench.metrics import REPORT_KEYS
from kvscope.app.bench.report import add_ratios, format_table
from kvscope.app.bench.systems import SYSTEMS, VLLM
from kvscope.app.bench.systems_cli import run_logging, run_throughput
from kvscope.app.bench.workloads import BenchRequest, Workload, warm_up_request
from kvscope.app.cli import build_parser, main
from kvscope.engine.model.packed_linear import is_packed

OUTPUT_LENGTHS = (2, 5, 3)
SMALL_CB = ContinuousSettings(page_size=16, max_batch_tokens=64, max_requests_per_batch=4)


def _workload(n: int = 1, temperature: float = 0.0) -> Workload:
    requests = tuple(BenchRequest(tuple(range(2000 + 7 * i, 2000 + 7 * i + p)), o, n)
                     for i, (p, o) in enumerate(zip((9, 4, 13), OUTPUT_LENGTHS, strict=True)))
    return Workload("tiny", requests, max_model_len=64, kv_cache_tokens=512, temperature=temperature)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices gain nothing from a second thread, and on a busy machine spinning threads cost a lot.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama")


def test_hf_static_counts_only_each_requests_own_tokens(tiny):
    model, tok = tiny
    run = StaticBatchRun(model, tok.pad_token_id, StaticSettings(batch_size=2))
    record = run.run(_workload(), warm_up_request())
    # Batches [2, 5] and [3]: 2*5 + 1*3 = 13 tokens generated, 10 of them asked for.
    assert record.num_output_tokens == 10
    assert record.extra["generated_tokens"] == 13
    assert record.extra["wasted_token_fraction"] == pytest.approx(3 / 13)
    assert [len(t) for t in record.token_times] == list(OUTPUT_LENGTHS)
    assert record.batch_sizes == [2] * 5 + [1] * 3
    assert record.prefill_tokens_computed == 2 * 9 + 13
    assert 0 < record.kv_used_slots < record.kv_reserved_slots


def test_hf_static_parallel_sampling(tiny):
    model, tok = tiny
    workload = _workload(n=2, temperature=0.8)
    run = StaticBatchRun(model, tok.pad_token_id, StaticSettings(batch_size=4))
    record = run.run(workload, warm_up_request(2))
    assert record.num_output_tokens == workload.num_output_tokens == 20


def test_hf_cb_gives_each_request_its_own_length(tiny):
    model, tok = tiny
    record = ContinuousBatchRun(model, tok.pad_token_id, SMALL_CB).run(_workload(), warm_up_request())
    assert record.num_output_tokens == sum(OUTPUT_LENGTHS)
    assert [len(t) for t in record.token_times] == list(OUTPUT_LENGTHS)
    assert record.settings["num_blocks"] == 512 // 16 and record.settings["max_requests_per_batch"] == 4
    assert model.config._attn_implementation == "sdpa"   # the manager put the model back as it found it


def test_harness_runs_every_system_on_one_model(tiny):
    model, tok = tiny
    systems = tuple(s for s in SYSTEMS if s != VLLM)  # vLLM has its own tests (test_bench_vllm.py)
    options = BenchOptions(model="tiny", device="cpu", dtype="float32", systems=systems, continuous=SMALL_CB)
    bench = Bench(model, tok, options, progress=lambda line: None)
    rows = add_ratios(bench.run([_workload()]))
    assert [r["system"] for r in rows] == list(systems)
    assert not any(is_packed(m) for m in model.modules())  # the transformers systems ran stock linear layers
    for row in rows:
        assert set(REPORT_KEYS) <= set(row)
        assert row["output_tokens"] == sum(OUTPUT_LENGTHS) and row["output_tokens_per_s"] > 0
        assert row["peak_rss_mb"] > 0
    paged = rows[0]
    assert paged["forward_floor_output_tokens_per_s"] > 0 and paged["fraction_of_floor"] > 0
    assert paged["paged_ratio"] is None and all(r["paged_ratio"] > 0 for r in rows[1:])
    table = format_table(rows, bench.notes)
    assert "forward-only floor" in table and "hf-cb settings" in table and "wasted" in table


def test_cli_parses_the_bench_command():
    args = build_parser().parse_args(["bench", "throughput", "--workload", "overload", "--systems", "hf-cb", "--json"])
    assert (args.func, args.workload, args.systems, args.json) == (run_throughput, "overload", "hf-cb", True)
    assert build_parser().parse_args(["bench", "workloads"]).func is run_throughput   # the name it had
    assert build_parser().parse_args(["bench", "logging"]).func is run_logging


def test_cli_rejects_unknown_systems_and_dtypes():
    with pytest.raises(SystemExit, match="unknown system"):
        main(["bench", "throughput", "--systems", "sglang"])
    with pytest.raises(SystemExit, match="--dtype"):
        main(["bench", "throughput", "--dtype", "int4"])


def test_cli_runs_the_workloads_end_to_end(tiny, tmp_path, capsys, monkeypatch):
    model, tok = tiny
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    asked = []

    def small_workloads(name, num_requests, seed):
        asked.append((name, num_requests, seed))
        return [_workload()]

    monkeypatch.setattr("kvscope.app.bench.workloads.build_workloads", small_workloads)
    code = main(["bench", "throughput", "--model", str(tmp_path / "tiny"), "--requests", "3", "--json",
                 "--device", "cpu", "--systems", "kvscope-paged,hf-static", "--db", str(tmp_path / "runs.db"),
                 "--no-floor"])
    assert code == 0 and asked == [("mixed", 3, 0)]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["workload"], r["system"]) for r in lines] == [("tiny", "kvscope-paged"), ("tiny", "hf-static")]
    assert lines[1]["paged_ratio"] > 0 and lines[0]["requests"] == 3
    # Accuracy beside speed, against transformers fp32 on the tiny model's own weights, in every JSON line too.
    assert all((r["first_token_agreement"], r["accuracy_sample"], r["equal_alone"]) == (3, 3, 3) for r in lines)
    with sqlite3.connect(tmp_path / "runs.db") as db:
        # The runner's name for the model, as the app and kvscope chat record it, not the --model path.
        assert db.execute("SELECT source, status, model FROM runs").fetchall() == [("bench", "finished", "tiny")]
        assert db.execute("SELECT count(*) FROM requests").fetchone() == (3,)


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    """transformers' fp32 and bf16 generate on the tiny workload: what the rows' accuracy is scored against."""
    model, tok = tiny
    bf16 = tiny_model("llama", dtype=torch.bfloat16)[0]
    return build_reference(model, bf16, _workload(), tok.pad_token_id)


def test_every_system_that_produces_tokens_gets_its_accuracy_beside_its_speed(tiny, tiny_reference):
    model, tok = tiny
    systems = ("kvscope-paged", "kvscope-contiguous", "hf-static", "hf-cb")
    options = BenchOptions(model="tiny", device="cpu", dtype="float32", systems=systems, continuous=SMALL_CB,
                           forward_floor=False)
    bench = Bench(model, tok, options, progress=lambda line: None, references={"tiny": tiny_reference})
    rows = add_ratios(bench.run([_workload()]))
    assert tiny_reference.sample.indices == (0, 1, 2) and tiny_reference.sample.tokens == OUTPUT_LENGTHS
    for row in rows:   # fp32 on a model without near ties: every system is transformers fp32, batched or alone
        assert (row["first_token_agreement"], row["accuracy_sample"], row["equal_alone"]) == (3, 3, 3), row
        assert row["mean_leading_agreement"] == sum(OUTPUT_LENGTHS) / 3
        assert row["below_transformers_bf16"] is False
    table = format_table(rows, bench.notes)
    header, first_row = table.splitlines()[1:3]
    assert header.split()[-4:] == ["first", "lead", "=", "alone"] and first_row.split()[-3:] == ["3/3", "3.3", "3/3"]
    assert f"transformers bf16 scores {tiny_reference.bf16.text()}" in table


def test_a_row_below_transformers_bf16_is_marked(tiny_reference):
    fp32 = {i: list(tokens) for i, tokens in zip(tiny_reference.sample.indices, tiny_reference.fp32_tokens)}
    wrong_first = {i: [tokens[0] + 1, *tokens[1:]] for i, tokens in fp32.items()}
    fields = tiny_reference.row_fields(wrong_first, fp32)
    assert fields["first_token_agreement"] == 0 and fields["mean_leading_agreement"] == 0
    assert fields["below_transformers_bf16"] is True and fields["equal_alone"] == 0
    row = {"workload": "tiny", "dtype": "bfloat16", "system": "kvscope-paged", "requests": 3, "output_tokens": 10,
           "output_tokens_per_s": 1.0, **fields}
    assert format_table([row]).splitlines()[2].split()[-3:] == ["0/3!", "0.0!", "0/3"]
    assert tiny_reference.row_fields(fp32, fp32)["below_transformers_bf16"] is False


def test_batch_dependence_counts_requests_whose_tokens_differ_from_running_alone(tiny_reference):
    fp32 = {i: list(tokens) for i, tokens in zip(tiny_reference.sample.indices, tiny_reference.fp32_tokens)}
    late = fp32 | {2: [*fp32[2][:-1], fp32[2][-1] + 1]}   # request 2 differs in its last token
    assert equal_alone(tiny_reference.sample, fp32, late) == 2
    assert tiny_reference.row_fields(fp32, late)["equal_alone"] == 2


def test_a_sampled_workload_says_why_it_has_no_accuracy(tiny, tiny_reference):
    model, tok = tiny
    options = BenchOptions(model="tiny", device="cpu", dtype="float32", systems=("kvscope-paged",),
                           forward_floor=False)
    bench = Bench(model, tok, options, progress=lambda line: None, references={"other": tiny_reference})
    [row] = bench.run([_workload(temperature=0.8)])
    assert row.get("first_token_agreement") is None
    assert "accuracy: not measured (sampled at temperature 0.8" in format_table([row], bench.notes)
