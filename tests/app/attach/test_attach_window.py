"""The attached window at fixed terminal sizes, fed with frames made from recorded vLLM data.

Update with `pytest tests/test_attach_window.py --snapshot-update` and look at the SVGs.
"""

from __future__ import annotations

import dataclasses
import time

import msgspec
import pytest
from attach_frames import RecordedSource, busy_source, recorded_server, status
from vllm_fakes import SHARED, recorded_payloads

from kvscope.app.attach.feed.frame import DISCONNECTED, Connection, Notice
from kvscope.app.attach.feed.metrics import parse_metrics
from kvscope.app.attach.feed.tokens import load_preview_text
from kvscope.app.attach.window.app import AttachApp
from kvscope.app.attach.window.widgets.events_panel import describe_events
from kvscope.app.attach.window.widgets.prefix_trees import describe_prefixes
from kvscope.app.attach.window.widgets.server_queues import describe_queues
from kvscope.settings import settings

PAGE = (SHARED / "metrics.txt").read_text()


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """Notices show local times: fix the zone so snapshots are the same everywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def smollm2_preview():
    return load_preview_text(str(settings().cache_dir / "models" / "SmolLM2-135M-Instruct"))


def app_showing(source: RecordedSource, **frame_changes) -> AttachApp:
    app = AttachApp(source, run_thread=False, db_path="/nonexistent/runs.db")
    frame = dataclasses.replace(source.make_frame(), **frame_changes)

    async def show(pilot) -> None:
        app.view.show_frame(frame)
        app.view.paint(force=True)
        await pilot.pause()

    app.show = show
    return app


def test_a_busy_server(snap_compare):
    app = app_showing(busy_source(*smollm2_preview()))
    assert snap_compare(app, terminal_size=(160, 48), run_before=app.show)


def test_a_busy_server_80x24(snap_compare):
    app = app_showing(busy_source(*smollm2_preview()))
    assert snap_compare(app, terminal_size=(80, 24), run_before=app.show)


def test_a_server_without_events_says_which_flag_turns_them_on(snap_compare):
    source = RecordedSource(recorded_server(events=False))
    source.take_sample(parse_metrics(PAGE.replace('kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.0',
                                                  'kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.4'), 0))
    frame = source.make_frame()
    assert "--kv-events-config" in describe_events(frame) and "no KV-cache events" in describe_prefixes(frame)
    assert frame.pools[0].num_in_use_blocks == 38 and frame.pools[0].num_unannounced_blocks == 38
    app = app_showing(source)
    assert snap_compare(app, terminal_size=(120, 36), run_before=app.show)


def test_lost_server_and_restart_notices(snap_compare):
    source = busy_source()
    source.notices.append(Notice(1_796_154_600.0, "lost http://127.0.0.1:8011: connection refused or host not found"))
    source.notices.append(Notice(1_796_154_604.0, "the server restarted: its pool was cleared here and rebuilt from "
                                                  "what it replays"))
    app = app_showing(source, connection=Connection(DISCONNECTED, "connection refused or host not found", 2.0))
    assert snap_compare(app, terminal_size=(120, 36), run_before=app.show)


def test_two_data_parallel_ranks_get_a_map_each(snap_compare):
    source = RecordedSource(recorded_server(ranks=2))
    payloads = recorded_payloads()
    for rank in range(2):
        moved = [msgspec.msgpack.encode([ts, events, rank]) for ts, events, _ in
                 (msgspec.msgpack.decode(p) for p in payloads[:9 + 30 * rank])]
        source.deliver(moved, stream_index=rank)
    two = PAGE + "\n".join(line.replace('engine="0"', 'engine="1"') for line in PAGE.splitlines()
                           if line.startswith("vllm:num_requests") or line.startswith("vllm:kv_cache_usage"))
    source.take_sample(parse_metrics(two, 0))
    source.stream_statuses = (status(8, 37), status(38, 150, endpoint="tcp://127.0.0.1:5558"))
    frame = source.make_frame()
    assert [p.label for p in frame.pools] == ["rank 0", "rank 1"]
    app = app_showing(source)
    assert snap_compare(app, terminal_size=(160, 48), run_before=app.show)


def test_the_queue_panel_says_what_vllm_does_not_expose():
    text = describe_queues(busy_source().make_frame())
    assert "per-request rows" in text and "no swapped queue" in text and "waiting by reason" in text


@pytest.mark.anyio
async def test_a_pool_that_appears_later_gets_its_own_map():
    server = recorded_server()
    server = dataclasses.replace(server, event_sources=tuple(dataclasses.replace(s, rank=None)
                                                             for s in server.event_sources))
    source = RecordedSource(server)
    app = AttachApp(source, run_thread=False, db_path="/nonexistent/runs.db")
    async with app.run_test(size=(160, 48)) as pilot:
        assert len(app.view.maps) == 1
        payloads = recorded_payloads()
        source.deliver(payloads[:5])
        source.deliver([msgspec.msgpack.encode([ts, events, 1]) for ts, events, _ in
                        (msgspec.msgpack.decode(p) for p in payloads[:5])])
        app.view.show_frame(source.make_frame())
        app.view.paint(force=True)
        await pilot.pause()
        assert [m.border_title for m in app.view.maps] == ["Block map · rank 0 · 54 announced of 96",
                                                           "Block map · rank 1 · 54 announced of 96"]


@pytest.mark.anyio
@pytest.mark.parametrize("key", ["q", "f10"])
async def test_the_attached_window_quits_and_saves_screenshots_with_the_apps_keys(key, tmp_path):
    """F10 saved a screenshot and q did nothing; only Ctrl+Q, which no footer shows, quit."""
    app = AttachApp(busy_source(), run_thread=False, db_path="/nonexistent/runs.db", screenshot_dir=tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert len(list(tmp_path.glob("*.svg"))) == 1
        footer = str(app.screen.query_one("#keys").render())
        assert "q Quit" in footer
        await pilot.press(key)
        await pilot.pause()
    assert app.return_code == 0 and len(list(tmp_path.glob("*.svg"))) == 1


@pytest.mark.parametrize("swap_blocks", [None, 32])
def test_attached_to_kvscope_serve_the_window_names_it_and_words_its_swapped_queue(swap_blocks):
    """The window called a `kvscope serve` vLLM, and said there is no swapped queue even in swap mode."""
    from kvscope.app.attach.feed.server import server_kind
    from kvscope.app.attach.window.widgets.header import describe_server
    from kvscope.app.attach.window.widgets.server_counters import describe_counters

    assert server_kind("kvscope 0.4.0", None) == "kvscope" and server_kind("0.32.0", "kvscope") == "kvscope"
    assert server_kind("0.32.0", "vllm") == "vLLM"
    source = busy_source()
    source.server = dataclasses.replace(source.server, version="kvscope 0.4.0", kind="kvscope",
                                        swap_blocks=swap_blocks)
    frame = source.make_frame()
    queues = describe_queues(frame)
    assert "vLLM publishes" not in queues and "V1 scheduler" not in queues
    header = describe_server(frame)
    assert header.startswith("$version") and frame.server.version_label == "kvscope 0.4.0"
    counters = describe_counters(frame)
    if swap_blocks:
        assert "host pool of 32 blocks" in queues and "no swapped queue" not in queues
        assert "never swapped" not in counters and "swapped out" in counters
    else:
        assert "no swapped queue" in queues and "recompute mode" in queues
    vllm = busy_source().make_frame()
    assert vllm.server.version_label == "vLLM 0.32.0" and "V1 scheduler" in describe_queues(vllm)
