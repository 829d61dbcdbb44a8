"""`kvscope attach` before the window opens, and `kvscope bench attach` on a small scale."""

from __future__ import annotations

import pytest
from vllm_fakes import SHARED, FakeServer

from kvscope.app.attach import bench
from kvscope.app.cli import main


@pytest.mark.parametrize("argv, says", [
    (["--interval", "0"], "--interval must be at least 0.1 s"),
    (["--kv-events", "host:5557"], "give a ZMQ address such as tcp://host:5557"),
    (["--kv-events", "tcp://h:1", "--replay", "tcp://h:2", "--replay", "tcp://h:3"], "paired with --kv-events"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, says):
    server = FakeServer((SHARED / "metrics.txt").read_text())
    try:
        assert main(["attach", server.url, *argv]) == 2
    finally:
        server.close()
    err = capsys.readouterr().err
    assert err.startswith("kvscope attach: error: ") and says in err and err.count("\n") == 1


def test_an_unreachable_server_exits_2_before_the_window(capsys):
    server = FakeServer("")
    server.stop()
    assert main(["attach", server.url, "--no-log"]) == 2
    assert capsys.readouterr().err == f"kvscope attach: error: cannot reach {server.url}: connection refused or " \
                                      "host not found\n"


def test_a_url_that_is_not_vllm_exits_2(capsys):
    server = FakeServer("<html>a web page</html>")
    try:
        assert main(["attach", server.url, "--no-log"]) == 2
    finally:
        server.close()
    assert "is not a vLLM server" in capsys.readouterr().err


def test_bench_attach_applies_every_event_it_sends():
    result = bench.run_rate(rate=2_000, seconds=1.0, pool_blocks=50_000)
    assert result.events_sent > 1_000 and result.events_applied == result.events_sent
    assert 0 < result.cpu_share and result.frames >= 1


def test_bench_attach_fills_and_churns_a_pool():
    memory = bench.run_memory(pool_blocks=20_000)
    assert memory.known_after_fill >= 0.98 * 20_000 and memory.events_churned >= memory.events_to_fill
    report = bench.report(bench.RateResult(10_000, 1.0, 10, 10, 10.0, 0.1, 3), memory)
    assert "CPU, share of one core" in report and "20,000 blocks" in report


def test_rounds_rename_every_hash_and_keep_the_structure():
    batches = bench.recorded_batches()
    first, second = bench.round_batches(batches, 0), bench.round_batches(batches, 1)
    assert first[0][1][0]["block_hashes"] == batches[0][1][0]["block_hashes"]
    assert set(first[0][1][0]["block_hashes"]).isdisjoint(second[0][1][0]["block_hashes"])
    assert second[1][1][0]["parent_block_hash"] == second[0][1][0]["block_hashes"][-1]
