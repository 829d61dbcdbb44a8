"""kvscope attach with the README's explicit endpoints against a live vLLM: samples and events keep coming.

`kvscope attach URL --kv-events tcp://HOST:5557 --replay tcp://HOST:5558` once showed the server's first
sample and then nothing (issue 24): an endpoint given by hand names no rank, so no pool existed at the first
sample, the run log's step of zero pools raised, and the data source thread ended without a word. Here the
window is built from exactly those flags, as the command line builds it (its run log on), and watched
while the OpenAI client loads the server.
"""

from __future__ import annotations

import threading

import load
import pytest

from kvscope.app.attach.cli import prepare
from kvscope.app.cli import build_parser
from kvscope.app.runlog import RunLogReader


@pytest.mark.anyio
async def test_the_readmes_explicit_endpoints_keep_samples_and_events_coming(vllm_server, tmp_path):
    server = vllm_server
    args = build_parser().parse_args([
        "attach", server.url, "--kv-events", f"tcp://127.0.0.1:{server.events_port}",
        "--replay", f"tcp://127.0.0.1:{server.replay_port}", "--interval", "0.5", "--db", str(tmp_path / "runs.db")])
    app = prepare(args)
    try:
        seen, last = await watch_under_load(app, server)
    finally:
        app.source.client.close()
    samples = [s for s, _ in seen]
    seqs = [q for _, q in seen if q is not None]
    # New samples all through the load (never five looks in a row without one), and new events.
    stalls = [later - earlier for earlier, later in zip(samples, samples[4:])]
    assert samples == sorted(samples) and min(stalls, default=1) > 0, samples
    assert len(seqs) >= 2 and seqs[-1] > seqs[0], seen
    assert last.pools[0].counters.num_stored > 0 and last.rates.hit_rate is not None
    reader = RunLogReader(tmp_path / "runs.db")
    (run,) = reader.list_runs()
    assert run["status"] == "finished" and reader.run(run["id"])["num_steps"] >= samples[-1] - 1
    reader.close()


async def watch_under_load(app, server) -> tuple[list[tuple[int, int | None]], object]:
    """(samples, last event seq) each second the window drew them while the load ran, and the last frame."""
    seen: list[tuple[int, int | None]] = []
    async with app.run_test(size=(160, 48)) as pilot:
        for _ in range(100):
            if app.view.latest is not None and app.view.latest.sample_index >= 2:
                break
            await pilot.pause(0.1)
        client = load.client_for(server.url)
        work = threading.Thread(target=lambda: (load.shared_phase(client), load.overload_phase(client)))
        work.start()
        while work.is_alive():
            await pilot.pause(1.0)
            frame = app.view._painted
            seen.append((frame.sample_index, frame.streams[0].last_seq))
        await pilot.pause(1.5)
        last = app.view._painted
        seen.append((last.sample_index, last.streams[0].last_seq))
        assert last.connection.state == "connected" and last.streams[0].error is None
        assert app.view.maps[0].border_title.startswith("Block map · rank 0 · ")
    return seen, last
