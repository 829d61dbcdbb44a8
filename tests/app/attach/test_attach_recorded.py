"""The samples recorded by tests/vllm/record_samples.py from a live vLLM 0.32 server, played back in time
order through the data source: the shared prompt reused, the overload evicting, the reset clearing."""

from __future__ import annotations

import gzip
import json

from attach_frames import RecordedSource, recorded_server
from vllm_fakes import DATA

from kvscope.app.attach.feed.events import BatchDecoder
from kvscope.app.attach.feed.metrics import parse_metrics
from kvscope.app.attach.feed.recording import live_messages, read_messages
from kvscope.app.attach.feed.subscriber import Delivery

RECORDED = DATA / "recorded"


def timeline() -> list[tuple[float, str, object]]:
    """Events and metrics pages, in the order the server produced them."""
    decoder = BatchDecoder()
    items = []
    for _, seq, payload in live_messages(RECORDED / "kv-events.frames.jsonl"):
        batch = decoder.decode(payload)
        items.append((batch.ts, "events", Delivery(seq, batch)))
    series = gzip.open(RECORDED / "metrics-timeseries.txt.gz", "rt").read()
    for chunk in series.split("# t=")[1:]:
        stamp, _, page = chunk.partition("\n")
        items.append((float(stamp), "metrics", parse_metrics(page, float(stamp))))
    return sorted(items, key=lambda item: item[0])


def play() -> tuple[RecordedSource, list]:
    source = RecordedSource(recorded_server())
    frames = []
    for _, kind, item in timeline():
        if kind == "events":
            source.apply(0, [item])
        else:
            source.take_sample(item)
        frames.append((kind, source.make_frame()))
    return source, frames


def test_the_recorded_run_plays_back_within_the_pool():
    phases = json.loads((RECORDED / "phases.json").read_text())
    source, frames = play()
    pools = [frame.pools[0] for _, frame in frames]
    assert max(p.num_known_blocks for p in pools) <= 95 and all(p.counters.num_overflow == 0 for p in pools)
    last = pools[-1]
    assert last.counters.num_removed > 0 and last.counters.num_cleared == 1
    assert last.counters.num_unknown_removed == 0
    # after the reset, only the last request's blocks: its 16-block prompt and one generated block
    assert last.num_known_blocks == 17 and last.num_trees == 1
    waiting = [f.queue_history[-1].num_waiting for kind, f in frames
               if kind == "metrics" and phases["overload"][0] <= f.queue_history[-1].time <= phases["overload"][1]]
    assert max(waiting) > 0


def test_the_shared_system_prompt_is_one_tree_reused_by_the_requests():
    source, frames = play()
    before_overload = [f for kind, f in frames if kind == "events"][7]
    (tree, *_) = before_overload.pools[0].trees
    assert tree.num_blocks >= 16 and not tree.partial
    assert tree.num_reuses >= 3            # the questions after the first branched off its last full block
    assert tree.num_branches >= 2


def test_the_usage_band_is_what_metrics_say_beyond_the_announced_blocks():
    _, frames = play()
    for kind, frame in frames:
        pool = frame.pools[0]
        if kind == "metrics" and pool.num_in_use_blocks is not None:
            assert pool.num_in_use_blocks == round(frame.metrics.totals().kv_usage * 95)
            assert pool.num_unannounced_blocks == max(0, pool.num_in_use_blocks - pool.num_known_blocks)


def test_the_recorded_replay_ends_with_the_end_marker():
    replies = list(read_messages(RECORDED / "kv-replay.frames.jsonl"))
    assert replies[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == list(range(len(replies) - 1))
