"""kvscope attach against servers that misbehave: nothing a server sends can freeze the data source, make
quitting wait, grow memory without bound, or be taken for something it is not (issue 24).

Memory bounds are measured with tracemalloc around the work (Python's own allocations, which is where
anything a server sends would pile up) and stated next to each test.
"""

from __future__ import annotations

import contextlib
import threading
import tracemalloc

import msgspec
import pytest
from hostile_fakes import HostileHTTP, HostilePublisher, batch, endless, page, silent, trickle
from vllm_fakes import SHARED, FakePublisher, until

from kvscope.app.attach.feed import replay as replay_module
from kvscope.app.attach.feed import server as server_module
from kvscope.app.attach.feed.fetch import Fetcher
from kvscope.app.attach.feed.frame import DISCONNECTED
from kvscope.app.attach.feed.limits import MAX_LABELS, MAX_UNKNOWN_KINDS, METRICS_MAX_BYTES
from kvscope.app.attach.feed.metrics import parse_metrics
from kvscope.app.attach.feed.server import AttachError, EventEndpoint, probe_server
from kvscope.app.attach.feed.source import AttachSource
from kvscope.app.attach.feed.subscriber import EventStream
from kvscope.app.attach.window.app import CLOSE_TIMEOUT_S
from kvscope.app.attach.window.widgets.events_panel import describe_unknown
from kvscope.app.attach.window.widgets.server_queues import describe_queues
from kvscope.app.cli import main

PAGE = (SHARED / "metrics.txt").read_text()
MiB = 1 << 20


@pytest.fixture
def fetcher():
    with Fetcher() as fetcher:
        yield fetcher


@contextlib.contextmanager
def hostile(routes):
    server = HostileHTTP(routes)
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def running(source: AttachSource, first_sample):
    """The source in its thread, as the window runs it; stopped, and checked to have finished, at the end."""
    thread = threading.Thread(target=source.run, args=(first_sample,), daemon=True)
    thread.start()
    try:
        yield source
    finally:
        source.stop()
        # The window waits this long for the thread when it quits; nothing the server does may hold it up.
        assert source.finished.wait(CLOSE_TIMEOUT_S), "the data source did not stop within the window's wait"


class Frames(list):
    def __call__(self, frame) -> None:
        self.append(frame)


@contextlib.contextmanager
def peak_growth():
    """Yields a list that receives, at exit, the peak bytes Python allocated above where it started."""
    result: list[int] = []
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield result
    finally:
        result.append(tracemalloc.get_traced_memory()[1] - base)
        tracemalloc.stop()


def attach_fails(capsys, url: str) -> str:
    assert main(["attach", url, "--no-log"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope attach: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


# --- every request has a total deadline and a byte cap ------------------------------------------------


def test_a_page_that_never_ends_is_refused_at_start_within_its_deadline(capsys, monkeypatch):
    monkeypatch.setattr(server_module, "METRICS_DEADLINE_S", 0.5)
    with hostile({"/metrics": trickle(every_s=0.1)}) as server:
        err = attach_fails(capsys, server.url)
        until(lambda: server.open == 0)     # the client hung up: nothing is left reading
    assert "no whole answer in 0.5 s" in err


def test_a_page_that_never_ends_while_attached_reads_disconnected_and_stop_cancels_it(fetcher, monkeypatch):
    with hostile({"/metrics": page(PAGE)}) as server:
        info, sample = probe_server(fetcher, server.url)
        frames = Frames()
        with running(AttachSource(info, client=fetcher, publish=frames, interval_s=0.05), sample):
            server.routes["/metrics"] = trickle(every_s=0.1)
            monkeypatch.setattr(server_module, "METRICS_DEADLINE_S", 0.5)
            until(lambda: any(f.connection.state == DISCONNECTED for f in frames), timeout_s=10)
            monkeypatch.setattr(server_module, "METRICS_DEADLINE_S", 60.0)
            until(lambda: server.open == 1)     # a GET is in flight again, trickling; now quit
        until(lambda: server.open == 0)         # stop() cancelled it: the connection was closed
    lost = next(f.connection for f in frames if f.connection.state == DISCONNECTED)
    assert lost.detail == "no whole answer in 0.5 s"


@pytest.mark.parametrize("declared", [None, 300 * MiB])
def test_a_huge_page_is_refused_at_the_cap_without_being_held(capsys, declared):
    """Memory bound: the peak of Python allocations stays under 3 x the 8 MiB cap (the body, and the
    bytes it is decoded from, once each), whatever the server sends."""
    with hostile({"/metrics": endless(declared=declared)}) as server:
        with peak_growth() as peak:
            err = attach_fails(capsys, server.url)
        until(lambda: server.open == 0)
    assert f"{METRICS_MAX_BYTES:,}" in err and peak[0] < 3 * METRICS_MAX_BYTES


def test_optional_pages_that_never_end_or_are_huge_are_left_out(fetcher, monkeypatch):
    monkeypatch.setattr(server_module, "INFO_DEADLINE_S", 0.3)
    with hostile({"/metrics": page(PAGE), "/version": trickle(every_s=0.05), "/v1/models": endless(),
                  "/kv_event_sources": silent}) as server:
        info, _ = probe_server(fetcher, server.url)
        until(lambda: server.open == 0)
    assert info.version == "unknown" and info.model == "smollm2" and info.event_sources == ()


# --- numbers are checked ------------------------------------------------------------------------------


def cache_config(blocks: str, block_size: str = "32") -> str:
    line = next(line for line in PAGE.splitlines() if line.startswith("vllm:cache_config_info{"))
    changed = line.replace('num_gpu_blocks="96"', f'num_gpu_blocks="{blocks}"') \
                  .replace('block_size="32"', f'block_size="{block_size}"')
    assert changed != line or (blocks, block_size) == ("96", "32")
    return PAGE.replace(line, changed)


def engines(count: int) -> str:
    lines = [line for line in PAGE.splitlines() if line.startswith("vllm:") and 'engine="0"' in line]
    return PAGE + "\n".join(line.replace('engine="0"', f'engine="{e}"') for e in range(1, count) for line in lines)


@pytest.mark.parametrize("page_text, says", [
    (cache_config("3000000000"), "num_gpu_blocks 3,000,000,000 is outside"),
    (cache_config("0"), "num_gpu_blocks 0 is outside"),
    (cache_config("-5"), "num_gpu_blocks -5 is outside"),
    (cache_config("96", "0"), "block_size 0 is outside"),
    (cache_config("96", "1000000"), "block_size 1,000,000 is outside"),
    (cache_config("lots"), "no num_gpu_blocks or block_size"),
    (engines(70), "more than 64 engines"),
    (PAGE.replace('kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.0',
                  'kv_cache_usage_perc{engine="0",model_name="smollm2"} NaN'), "kv_cache_usage_perc nan"),
    (PAGE.replace('generation_tokens_total{engine="0",model_name="smollm2"} 2018.0',
                  'generation_tokens_total{engine="0",model_name="smollm2"} -4.0'), "generation_tokens -4"),
    (PAGE.replace('num_requests_running{engine="0",model_name="smollm2"} 0.0',
                  'num_requests_running{engine="0",model_name="smollm2"} 1e300'), "num_running 1e+300"),
])
def test_absurd_numbers_are_refused_at_start_in_one_line(capsys, page_text, says):
    with hostile({"/metrics": page(page_text)}) as server:
        err = attach_fails(capsys, server.url)
    assert says in err, err


def test_while_attached_a_bad_page_is_a_bad_sample_never_a_restart(fetcher):
    vanished = "\n".join(line for line in PAGE.splitlines() if "generation_tokens" not in line
                         and "prompt_tokens" not in line)
    with hostile({"/metrics": page(PAGE)}) as server:
        info, sample = probe_server(fetcher, server.url)
        frames = Frames()
        with running(AttachSource(info, client=fetcher, publish=frames, interval_s=0.05), sample) as source:
            for bad in (vanished, cache_config("3000000000"), "vllm: garbage {{{"):
                seen = source.bad_samples.count
                server.routes["/metrics"] = page(bad)
                until(lambda seen=seen: source.bad_samples.count > seen)
            samples = source.sample_index
            server.routes["/metrics"] = page(PAGE)
            until(lambda: source.sample_index > samples and source.bad_samples.in_a_row == 0)
    last = frames[-1]
    texts = [n.text for n in last.notices]
    assert not any("restarted" in text for text in texts)
    assert any("series it had before are gone (vllm:generation_tokens, vllm:prompt_tokens)" in t for t in texts)
    assert last.bad_samples.count >= 3 and last.pools[0].num_blocks == 96
    assert last.server.num_gpu_blocks == 96 and last.connection.state != DISCONNECTED


def test_label_floods_are_capped_in_each_sample():
    reasons = "\n".join(f'vllm:num_requests_waiting_by_reason{{engine="0",reason="r{i}"}} {i % 7}.0'
                        for i in range(1000))
    sample = parse_metrics(PAGE + reasons + "\n", 0.0)
    (engine,) = sample.engines
    assert len(engine.waiting_by_reason) == MAX_LABELS
    # The page's own two reasons (zero each) are among those summed.
    assert engine.waiting_by_reason[-1] == ("(987 more)", sum(i % 7 for i in range(1000))
                                            - sum(count for _, count in engine.waiting_by_reason[:-1]))


def test_the_first_sample_is_a_baseline_not_the_servers_lifetime():
    from attach_frames import RecordedSource, recorded_server

    source = RecordedSource(recorded_server())
    source.take_sample(parse_metrics(PAGE, 0.0))
    stats = source.stats
    assert stats.num_generated_tokens == stats.num_prefill_tokens == stats.num_decode_tokens == 0
    later = PAGE.replace('generation_tokens_total{engine="0",model_name="smollm2"} 2018.0',
                         'generation_tokens_total{engine="0",model_name="smollm2"} 2030.0')
    source.take_sample(parse_metrics(later, 1.0))
    assert source.stats.num_generated_tokens == source.stats.num_decode_tokens == 12


# --- event streams: replays never wait, tables and memory are bounded -----------------------------------


def test_a_silent_replay_with_gaps_holds_up_neither_sampling_nor_stopping(fetcher, context, monkeypatch):
    monkeypatch.setattr(replay_module, "REPLAY_IDLE_S", 0.3)
    monkeypatch.setattr("kvscope.app.attach.feed.subscriber.REPLAY_COOLDOWN_S", 120.0)   # longer than the test
    publisher = HostilePublisher(context, "silent")
    try:
        with hostile({"/metrics": page(PAGE)}) as server:
            endpoints = (EventEndpoint(publisher.endpoint, publisher.replay_endpoint),)
            info, sample = probe_server(fetcher, server.url, event_endpoints=endpoints)
            frames = Frames()
            with running(AttachSource(info, client=fetcher, publish=frames, interval_s=0.05), sample) as source:
                publisher.wait_for_subscriber()
                for seq in range(0, 400, 2):        # every other batch missing: a gap per message
                    publisher.publish(seq, batch([]))
                # The source may not have published a frame yet (a loaded machine): none is no answer yet.
                until(lambda: frames and frames[-1].streams and frames[-1].streams[0].last_seq == 398, timeout_s=20)
                samples = source.sample_index
                until(lambda: source.sample_index > samples + 3)     # and sampling goes on
    finally:
        publisher.close()
    status = frames[-1].streams[0]
    # The first replay (from 0) found nobody answering: the gaps after it are counted, not asked for.
    assert publisher.replay_requests == [0] and status.num_lost == 199 and status.num_gaps == 199
    assert status.replay_problem == "replay from seq 0: no answer"


def test_an_endless_replay_is_cut_at_its_cap(context, monkeypatch):
    """Memory bound: 2,000 replayed batches applied as they come; Python's peak growth under 8 MiB."""
    monkeypatch.setattr(replay_module, "REPLAY_MAX_BATCHES", 2_000)
    stored = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1] * 32,
              "block_size": 32, "lora_id": None, "medium": "GPU"}
    publisher = HostilePublisher(context, "endless", payload=batch([stored]))
    stream = EventStream(context, EventEndpoint(publisher.endpoint, publisher.replay_endpoint))
    try:
        publisher.wait_for_subscriber()
        with peak_growth() as peak:
            stream.bootstrap()
            delivered = stream.wait_for_replay()
    finally:
        stream.close()
        publisher.close()
    status = stream.status()
    assert len(delivered) == status.num_replayed == 2_000 and not status.replaying
    assert status.replay_problem.startswith("replay from seq 0: cut after 2,000 batches")
    assert peak[0] < 8 * MiB


def test_unknown_kinds_from_a_flood_are_named_up_to_a_cap(context):
    """20,000 distinct unknown kinds: MAX_UNKNOWN_KINDS named, the rest counted; Python's peak growth
    under 4 MiB while they arrive."""
    publisher = FakePublisher(context)
    stream = EventStream(context, EventEndpoint(publisher.endpoint))
    try:
        publisher.wait_for_subscriber()
        got: list = []
        with peak_growth() as peak:
            for seq in range(200):
                publisher.publish(seq, batch([{"type": f"Kind{seq}-{i}"} for i in range(100)]), buffered=False)
                if seq % 20 == 19:
                    until(lambda s=seq: got.extend(stream.drain()) or stream.last_seq == s)
    finally:
        stream.close()
        publisher.close()
    status = stream.status()
    assert len(status.unknown_kinds) == MAX_UNKNOWN_KINDS and status.num_batches == 200
    assert sum(c for _, c in status.unknown_kinds) + status.num_other_unknown == 20_000
    assert peak[0] < 4 * MiB
    text = describe_unknown(status)
    assert text.endswith(f"and {status.num_other_kinds + MAX_UNKNOWN_KINDS - 4:,} more kinds (19,996 events)")


def test_batches_naming_an_implausible_rank_are_refused(context):
    publisher = FakePublisher(context)
    stream = EventStream(context, EventEndpoint(publisher.endpoint))
    try:
        publisher.wait_for_subscriber()
        publisher.publish(0, batch([], rank=10**6), buffered=False)
        publisher.publish(1, batch([], rank=-1), buffered=False)
        publisher.publish(2, batch([], rank=3), buffered=False)
        got: list = []
        until(lambda: got.extend(stream.drain()) or stream.last_seq == 2)
    finally:
        stream.close()
        publisher.close()
    assert [item.batch.data_parallel_rank for item in got] == [3]
    assert stream.status().num_malformed == 2


def test_a_message_past_the_size_cap_never_arrives(context, monkeypatch):
    monkeypatch.setattr("kvscope.app.attach.feed.subscriber.MAX_MESSAGE_BYTES", 4096)
    publisher = FakePublisher(context)
    stream = EventStream(context, EventEndpoint(publisher.endpoint))
    try:
        publisher.wait_for_subscriber()
        publisher.publish(0, batch([{"type": "Big", "pad": "x" * 100_000}]), buffered=False)
        sent = iter(range(1, 10**6))

        def small_one_arrived() -> bool:    # libzmq drops the link on the big one; the stream opens another
            publisher.publish(next(sent), batch([]), buffered=False)
            stream.check_link()
            stream.drain()
            return stream.last_seq is not None

        until(small_one_arrived)
    finally:
        stream.close()
        publisher.close()
    status = stream.status()
    assert status.num_batches >= 1 and not status.unknown_kinds and status.first_seq >= 1
    assert status.num_reopened == 1


def test_the_queue_panel_caps_and_escapes_reason_labels():
    from attach_frames import RecordedSource, recorded_server

    reasons = "\n".join(f'vllm:num_requests_waiting_by_reason{{engine="0",reason="[$accent]r{i}"}} 1.0'
                        for i in range(40))
    source = RecordedSource(recorded_server())
    source.take_sample(parse_metrics(PAGE + reasons + "\n", 0.0))
    line = next(line for line in describe_queues(source.make_frame()).splitlines() if "by reason" in line)
    assert line.count("\\[$accent]") == MAX_LABELS - 1 and "(27 more) 25" in line   # and the page's two


def test_refused_input_leaves_the_probe_a_clear_error_and_nothing_running(capsys):
    with hostile({"/metrics": page(b"\x00\xff" * 100)}) as server:
        attach_fails(capsys, server.url)
    assert threading.active_count() < 50


def test_an_attach_error_carries_no_control_characters(capsys):
    with hostile({"/metrics": page("vllm:x{le=\x1b]0;pwned\x07} 1\n")}) as server:
        err = attach_fails(capsys, server.url)
    assert "\x1b" not in err and "\x07" not in err


def test_probe_with_sources_listing_too_many_ranks_is_refused(fetcher):
    sources = {str(r): {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{6000 + r}"}
               for r in range(65)}
    with hostile({"/metrics": page(PAGE), "/kv_event_sources": page(msgspec.json.encode(sources), 200,
                                                                     "application/json")}) as server:
        with pytest.raises(AttachError, match="lists 65 KV-event sources"):
            probe_server(fetcher, server.url)


def test_the_servers_model_directory_is_only_looked_in_for_a_tokenizer(tmp_path):
    from kvscope.app.attach.feed.tokens import find_tokenizer_file

    (tmp_path / "tokenizer.json").write_text("{}")
    not_a_tokenizer = tmp_path / "notes.txt"
    not_a_tokenizer.write_text("secret")
    assert find_tokenizer_file(None, str(not_a_tokenizer)) is None      # a file the server names is not read
    assert find_tokenizer_file(None, "relative/dir") is None
    assert find_tokenizer_file(None, str(tmp_path)) == tmp_path / "tokenizer.json"
    assert find_tokenizer_file(str(not_a_tokenizer), None) == not_a_tokenizer    # the user's word is taken


def test_a_tick_that_raises_is_a_notice_and_the_watch_goes_on(fetcher, monkeypatch):
    monkeypatch.setattr("kvscope.app.attach.feed.source.FAULT_PAUSE_S", 0.05)
    with hostile({"/metrics": page(PAGE)}) as server:
        info, sample = probe_server(fetcher, server.url)
        frames = Frames()
        source = AttachSource(info, client=fetcher, publish=frames, interval_s=0.05)
        real_views, calls = source.pools.views, []

        def views_that_fail_once(*args):
            calls.append(args)
            if len(calls) == 3:
                raise RuntimeError("a bug in kvscope")
            return real_views(*args)

        source.pools.views = views_that_fail_once
        with running(source, sample):
            until(lambda: len(calls) > 10)
    texts = [n.text for n in frames[-1].notices]
    assert any(t.startswith("internal error, the watch goes on: RuntimeError: a bug in kvscope") for t in texts)
    assert frames[-1].sample_index > 5
