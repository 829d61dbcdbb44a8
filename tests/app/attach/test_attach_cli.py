"""`kvscope attach` before the window opens, and `kvscope bench attach` on a small scale."""

from __future__ import annotations

import pytest
import zmq
from test_attach_source import zmq_sources
from vllm_fakes import SHARED, FakePublisher, FakeServer, recorded_payloads

from kvscope.app.attach import bench
from kvscope.app.attach.cli import build_app
from kvscope.app.attach.feed.server import make_client, probe_server
from kvscope.app.cli import build_parser, main
from kvscope.app.runlog import RunLogReader


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
    assert memory.rss_after_second_churn_mib > 0
    report = bench.report(bench.RateResult(10_000, 1.0, 10, 10, 10.0, 0.1, 3), memory)
    assert "CPU, share of one core" in report and "20,000 blocks" in report


def test_rounds_rename_every_hash_and_keep_the_structure():
    batches = bench.recorded_batches()
    first, second = bench.round_batches(batches, 0), bench.round_batches(batches, 1)
    assert first[0][1][0]["block_hashes"] == batches[0][1][0]["block_hashes"]
    assert set(first[0][1][0]["block_hashes"]).isdisjoint(second[0][1][0]["block_hashes"])
    assert second[1][1][0]["parent_block_hash"] == second[0][1][0]["block_hashes"][-1]


@pytest.mark.anyio
async def test_the_window_attaches_and_shows_the_servers_pool(tmp_path):
    """kvscope attach as the command line builds it: probe, window, data source thread, run log."""
    context = zmq.Context()
    publisher = FakePublisher(context)
    for seq, payload in enumerate(recorded_payloads()):
        publisher.publish(seq, payload, live=False)
    server = FakeServer((SHARED / "metrics.txt").read_text(), sources=zmq_sources(publisher))
    args = build_parser().parse_args(["attach", server.url, "--db", str(tmp_path / "runs.db"),
                                      "--interval", "0.2"])
    client = make_client()
    try:
        info, sample = probe_server(client, server.url)
        app = build_app(args, client, info, sample)
        async with app.run_test(size=(160, 48)) as pilot:
            for _ in range(100):
                frame = app.view.latest
                if frame is not None and frame.streams and frame.streams[0].last_seq == 86:
                    break
                await pilot.pause(0.05)
            await pilot.pause(0.3)
            assert app.view.maps[0].border_title == "Block map · rank 0 · 94 announced of 96"
            assert "connected" in str(app.view.header.render())
    finally:
        client.close()
        publisher.close()
        server.close()
        context.destroy(linger=0)
    reader = RunLogReader(tmp_path / "runs.db")
    (run,) = reader.list_runs()
    assert run["source"] == "vllm" and run["status"] == "finished"
    reader.close()
