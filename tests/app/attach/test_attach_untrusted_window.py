"""The attached window as `kvscope attach` builds it, against servers that misbehave: what they send is drawn
as text, the window keeps drawing, quitting never waits on them, and the run log says what happened
(issue 24)."""

from __future__ import annotations

import contextlib
import json
import threading

import pytest
import zmq
from hostile_fakes import HostileHTTP, batch, page, trickle
from runlog_faults import fill_the_disk
from vllm_fakes import SHARED, FakePublisher, recorded_payloads

from kvscope.app.attach.cli import build_app
from kvscope.app.attach.feed import server as server_module
from kvscope.app.attach.feed.server import make_client, probe_server, user_endpoints
from kvscope.app.cli import build_parser, main
from kvscope.app.runlog import RunLogReader
from kvscope.app.screens.history import HistoryScreen

PAGE = (SHARED / "metrics.txt").read_text()
CONTROL = [chr(c) for c in (*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0))]
MODEL = "[@click=app.quit]\x1b]0;pwned\x07smollm2\x9b31m"
SHOWN_MODEL = "[@click=app.quit]]0;pwnedsmollm231m"


def no_control(text: str) -> bool:
    return not any(c in text for c in CONTROL)


@contextlib.contextmanager
def window(tmp_path, routes: dict, *flags: str, events=()):
    """The app `kvscope attach URL FLAGS` opens, on a hostile server, logging to tmp_path/runs.db."""
    server = HostileHTTP(routes)
    client = make_client()
    args = build_parser().parse_args(["attach", server.url, "--db", str(tmp_path / "runs.db"), "--interval", "0.1",
                                      *flags])
    try:
        info, sample = probe_server(client, server.url, event_endpoints=events)
        yield server, build_app(args, client, info, sample)
    finally:
        client.close()
        server.close()


async def until_frames(app, pilot, predicate, tries: int = 200) -> None:
    for _ in range(tries):
        frame = app.view.latest
        if frame is not None and predicate(frame):
            return
        await pilot.pause(0.05)
    raise TimeoutError("the window did not get there")


def header_content(app):
    return app.view.header.visual


@pytest.mark.anyio
async def test_markup_and_escapes_from_the_server_are_drawn_as_plain_text(tmp_path, capsys):
    reasons = PAGE.replace('reason="capacity"', 'reason="[b]cap\x1b[31m[/b]"')
    routes = {"/metrics": page(reasons), "/version": page(json.dumps({"version": "[/]"}), kind="application/json"),
              "/v1/models": page(json.dumps({"data": [{"id": MODEL, "max_model_len": "lots"}]}),
                                 kind="application/json")}
    with window(tmp_path, routes) as (server, app):
        async with app.run_test(size=(160, 48)) as pilot:
            await until_frames(app, pilot, lambda frame: frame.sample_index >= 2)
            app.view.paint(force=True)
            await pilot.pause()
            header = header_content(app)
            assert f"vLLM [/] · {SHOWN_MODEL} ·" in header.plain and no_control(header.plain)
            assert not any("click" in str(span.style) for span in header.spans)
            queues = "\n".join(line.plain for line in app.view.queues._lines)
            assert "[b]cap[31m[/b] 0" in queues and no_control(queues)
            await pilot.press("f9")
            await pilot.pause(0.3)
            assert isinstance(app.screen, HistoryScreen)
            summary = app.screen.query_one("#run-summary").visual.plain
            assert f"{SHOWN_MODEL} · vLLM [/] at {server.url}" in summary and no_control(summary)
        assert app.return_code in (None, 0)
    db = str(tmp_path / "runs.db")
    assert main(["runs", "--db", db]) == 0 and main(["runs", "show", "1", "--db", db]) == 0
    out = capsys.readouterr().out
    assert SHOWN_MODEL in out and "vLLM [/] at" in out and no_control(out.replace("\n", ""))


@pytest.mark.anyio
async def test_with_the_readmes_explicit_endpoints_samples_and_events_keep_coming(tmp_path):
    """`kvscope attach URL --kv-events tcp://… --replay tcp://…` showed one sample, then nothing: the
    given endpoint has no rank, so no pool existed at the first sample, the run log's step of zero pools
    raised, and the data source thread died without a word. Now it gets rank 0's pool up front."""
    context = zmq.Context()
    publisher = FakePublisher(context)
    payloads = recorded_payloads()
    for seq, payload in enumerate(payloads[:10]):
        publisher.publish(seq, payload, live=False)
    flags = ("--kv-events", publisher.endpoint, "--replay", publisher.replay_endpoint)
    try:
        with window(tmp_path, {"/metrics": page(PAGE)}, *flags,
                    events=user_endpoints([publisher.endpoint], [publisher.replay_endpoint])) as (_, app):
            async with app.run_test(size=(160, 48)) as pilot:
                await until_frames(app, pilot, lambda f: f.streams[0].last_seq == 9 and f.sample_index >= 3)
                publisher.wait_for_subscriber()
                for seq in range(10, len(payloads)):
                    publisher.publish(seq, payloads[seq])
                sampled = app.view.latest.sample_index
                await until_frames(app, pilot, lambda f: f.streams[0].last_seq == len(payloads) - 1
                                   and f.sample_index >= sampled + 3)
                assert app.view.maps[0].border_title == "Block map · rank 0 · 94 announced of 96"
    finally:
        publisher.close()
        context.destroy(linger=0)
    reader = RunLogReader(tmp_path / "runs.db")
    (run,) = reader.list_runs()
    assert run["status"] == "finished" and reader.run(run["id"])["num_steps"] >= 6
    reader.close()


@pytest.mark.anyio
async def test_the_window_keeps_drawing_through_a_flood_of_unknown_kinds(tmp_path):
    context = zmq.Context()
    publisher = FakePublisher(context)
    stop = threading.Event()

    def flood() -> None:
        seq = 0
        while not stop.is_set() and seq < 20_000:
            publisher.publish(seq, batch([{"type": f"Kind{seq}-{i}"} for i in range(50)]), buffered=False)
            seq += 1
            stop.wait(0.001)

    flags = ("--kv-events", publisher.endpoint)
    try:
        with window(tmp_path, {"/metrics": page(PAGE)}, *flags,
                    events=user_endpoints([publisher.endpoint], [])) as (_, app):
            async with app.run_test(size=(160, 48)) as pilot:
                publisher.wait_for_subscriber()
                threading.Thread(target=flood, daemon=True).start()
                await until_frames(app, pilot, lambda f: f.streams[0].num_batches > 200)
                painted = []
                for _ in range(6):      # frame after frame reaches the screen while the flood goes on
                    first = app.view._painted
                    await until_frames(app, pilot, lambda f, first=first: app.view._painted is not first
                                       and app.view._painted.sample_index > (first.sample_index if first else 0))
                    painted.append(app.view._painted.sample_index)
                events = "\n".join(line.plain for line in app.view.events._lines)
                assert painted == sorted(set(painted)) and "more kinds" in events
    finally:
        stop.set()
        publisher.close()
        context.destroy(linger=0)


@pytest.mark.anyio
async def test_quitting_does_not_wait_for_a_page_that_never_ends(tmp_path, monkeypatch):
    with window(tmp_path, {"/metrics": page(PAGE)}) as (server, app):
        async with app.run_test(size=(120, 36)) as pilot:
            await until_frames(app, pilot, lambda frame: frame.sample_index >= 2)
            monkeypatch.setattr(server_module, "METRICS_DEADLINE_S", 600.0)
            server.routes["/metrics"] = trickle(every_s=0.05)
            for _ in range(100):
                if server.open:
                    break
                await pilot.pause(0.05)
            assert server.open == 1     # a GET is in flight, and will not end by itself
        # The app waited CLOSE_TIMEOUT_S at most for the thread: it had finished by then.
        assert app.source.finished.is_set() and not app.source_running
    reader = RunLogReader(tmp_path / "runs.db")
    (run,) = reader.list_runs()
    assert run["status"] == "finished" and reader.run(run["id"])["status_detail"] is None
    reader.close()


@pytest.mark.anyio
async def test_a_full_disk_is_reported_in_the_window_and_the_run_reads_incomplete(tmp_path, monkeypatch):
    fill_the_disk(monkeypatch, tmp_path / "runs.db")
    with window(tmp_path, {"/metrics": page(PAGE)}) as (_, app):
        async with app.run_test(size=(120, 36)) as pilot:
            for _ in range(200):
                if any(n.title == "Run log" for n in app._notifications):
                    break
                await pilot.pause(0.05)
            (note,) = [n for n in app._notifications if n.title == "Run log"]
            assert "database or disk is full" in note.message and "the run continues without it" in note.message
    reader = RunLogReader(tmp_path / "runs.db")
    run = reader.run(reader.list_runs()[0]["id"])
    assert run["source"] == "vllm" and run["status"] == "incomplete"
    assert "database or disk is full" in run["status_detail"]
    reader.close()
