"""`kvscope bench attach`: what watching a vLLM server costs, with events recorded from a real one.

Two figures:

- **CPU at a given event rate.** A publisher in a child process replays the
  recorded batches over a real ZMQ socket at ``rate`` events/s, each round of
  the recording under fresh hashes (so blocks keep arriving and leaving as in a
  busy server), and serves the recorded /metrics page. This process runs the
  attach data source's own thread, as ``kvscope attach`` does: the subscriber,
  the pool model, frames within its budget, /metrics read every second. The
  window's drawing is not in it (``kvscope bench ui`` measures drawing). Its CPU
  time (all its threads, ZMQ's too) over the wall time is the share of one core
  it took; every event sent must have been applied.
- **Memory for a big pool.** A pool of ``pool_blocks`` blocks is filled with the
  same re-hashed rounds, then churned (each new round evicts the oldest one's
  blocks, as a full server does) for as many events again; resident memory
  after filling and after churning shows it stays bounded by the pool.
"""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import psutil
import zmq

from kvscope.app.attach.feed.events import STORED, BatchDecoder
from kvscope.app.attach.feed.frame import AttachFrame
from kvscope.app.attach.feed.pool import MASK64, PoolModel
from kvscope.app.attach.feed.pool_view import PoolPicture
from kvscope.app.attach.feed.recording import live_messages
from kvscope.app.attach.feed.server import EventEndpoint, ServerInfo, make_client
from kvscope.app.attach.feed.source import AttachSource

DATA = Path(__file__).with_name("data")
RECORDED_EVENTS = DATA / "kv-events.frames.jsonl"     # vLLM 0.32 CPU, 96 blocks of 32 (tests/data/vllm)
RECORDED_PAGE = DATA / "metrics.txt"
SALT = 0x9E3779B97F4A7C15   # a round's hashes are the recorded ones XOR round * SALT


@dataclass(frozen=True)
class RateResult:
    rate: float                 # events/s asked for
    seconds: float
    events_sent: int
    events_applied: int
    achieved_rate: float        # events applied per second of wall time
    cpu_share: float            # of one core
    frames: int


@dataclass(frozen=True)
class MemoryResult:
    pool_blocks: int
    events_to_fill: int
    known_after_fill: int
    rss_before_mib: float
    rss_after_fill_mib: float
    events_churned: int         # in each of two rounds of churn
    rss_after_churn_mib: float
    rss_after_second_churn_mib: float
    frame_ms: float             # building one frame of the full pool


def recorded_batches() -> list:
    """The recorded payloads, decoded once: (ts, [event dicts], rank)."""
    return [msgspec.msgpack.decode(payload) for _, _, payload in live_messages(RECORDED_EVENTS)]


def _rehash(value, salt: int):
    return None if value is None else (value ^ salt) & MASK64


def round_batches(batches: list, round_index: int) -> list:
    """The recording under round ``round_index``'s hashes (round 0 is the recording itself)."""
    salt = (round_index * SALT) & MASK64
    out = []
    for ts, events, rank in batches:
        renamed = []
        for event in events:
            event = dict(event)
            event["block_hashes"] = [_rehash(h, salt) for h in event["block_hashes"]]
            if "parent_block_hash" in event:
                event["parent_block_hash"] = _rehash(event["parent_block_hash"], salt)
            renamed.append(event)
        out.append([ts, renamed, rank])
    return out


# --- CPU at a rate ---------------------------------------------------------------------------------

class _PageHandler(BaseHTTPRequestHandler):
    page = b""

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        body = self.page if self.path == "/metrics" else b"{}"
        self.send_response(200 if self.path in ("/metrics", "/version") else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _serve(pipe, rate: float, seconds: float, ready) -> None:
    """The child process, the server's side: /metrics from the recorded page, and the recorded events
    as re-hashed rounds at ``rate`` events/s once the subscriber has joined."""
    _PageHandler.page = RECORDED_PAGE.read_bytes()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _PageHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    context = zmq.Context()
    socket = context.socket(zmq.XPUB)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.bind("tcp://127.0.0.1:*")
    pipe.send((f"http://127.0.0.1:{httpd.server_address[1]}", socket.getsockopt_string(zmq.LAST_ENDPOINT)))
    socket.recv()   # the subscription: the client is listening
    ready.wait()
    pipe.send(_publish_rounds(socket, rate, seconds))
    pipe.recv()     # the client has what it needs: stop serving
    socket.close(linger=0)
    context.term()
    httpd.shutdown()


def _publish_rounds(socket: zmq.Socket, rate: float, seconds: float) -> int:
    batches = recorded_batches()
    seq = sent = round_index = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for batch in round_batches(batches, round_index):
            delay = start + sent / rate - time.monotonic()
            if delay > 0.001:
                time.sleep(delay)
            socket.send_multipart([b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
            seq += 1
            sent += len(batch[1])
        round_index += 1
    return sent


def bench_server(num_blocks: int, url: str, endpoint: str) -> ServerInfo:
    """The server the child plays: vLLM 0.32's block size, a pool of ``num_blocks``, one publisher."""
    return ServerInfo(url=url, version="recorded", model="recorded", model_root=None, max_model_len=None,
                      num_gpu_blocks=num_blocks, block_size=32, engines=("0",), prefix_caching=True,
                      event_sources=(EventEndpoint(endpoint, topic="kv-events", rank=0),))


def run_rate(rate: float = 10_000, seconds: float = 10.0, pool_blocks: int = 1_000_000) -> RateResult:
    """The attach data source's own thread (its /metrics polls included) against the child process."""
    spawn = multiprocessing.get_context("spawn")
    pipe, child_pipe = spawn.Pipe()
    ready = spawn.Event()
    child = spawn.Process(target=_serve, args=(child_pipe, rate, seconds, ready), daemon=True)
    child.start()
    frames: list[AttachFrame] = []
    try:
        url, endpoint = pipe.recv()
        with make_client() as client:
            source = AttachSource(bench_server(pool_blocks, url, endpoint), client=client, publish=frames.append)
            thread = threading.Thread(target=source.run, daemon=True)
            thread.start()
            measured = _measure(source, pipe, ready, frames, seconds)
            source.stop()
            thread.join(10)
        pipe.send("done")
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    return RateResult(rate, measured["wall"], measured["sent"], measured["applied"],
                      measured["applied"] / measured["wall"], measured["cpu"] / measured["wall"],
                      len(frames))


def _applied(frames: list[AttachFrame]) -> int:
    return frames[-1].streams[0].num_events if frames and frames[-1].streams else 0


def _measure(source: AttachSource, pipe, ready, frames: list[AttachFrame], seconds: float) -> dict:
    """CPU of this process (the source's thread and ZMQ's I/O thread) from the first event sent until
    the last one sent has been applied."""
    start_wall, start_cpu = time.monotonic(), time.process_time()
    ready.set()
    sent = pipe.recv()
    deadline = time.monotonic() + 30
    while _applied(frames) < sent and time.monotonic() < deadline:
        time.sleep(0.005)
    return {"wall": time.monotonic() - start_wall, "cpu": time.process_time() - start_cpu,
            "sent": sent, "applied": _applied(frames)}


# --- memory for a big pool -------------------------------------------------------------------------

def _rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def run_memory(pool_blocks: int = 1_000_000) -> MemoryResult:
    batches = recorded_batches()
    decoder = BatchDecoder()
    rss_before = _rss_mib()
    pool = PoolModel(pool_blocks, 32)
    leftovers: deque[list] = deque()
    filled, round_index = 0, 0
    while pool.num_known_blocks < pool_blocks * 0.98:
        filled += _apply_round(pool, decoder, batches, round_index, leftovers, evict=False)
        round_index += 1
    rss_fill = _rss_mib()
    rss_churn = []
    for _ in range(2):     # bounded means the second round of churn leaves memory where the first did
        churned = 0
        while churned < filled:
            churned += _apply_round(pool, decoder, batches, round_index, leftovers, evict=True)
            round_index += 1
        rss_churn.append(_rss_mib())
    picture = PoolPicture(pool, "rank 0")
    picture.view(0, 0.5)
    started = time.perf_counter()
    picture.view(1, 0.5)
    frame_ms = (time.perf_counter() - started) * 1000
    return MemoryResult(pool_blocks, filled, pool.num_known_blocks, rss_before, rss_fill, churned, *rss_churn,
                        frame_ms)


def _apply_round(pool: PoolModel, decoder: BatchDecoder, batches: list, round_index: int,
                 leftovers: deque, evict: bool) -> int:
    """One re-hashed round; when ``evict``, the oldest round's blocks are evicted first (a full pool)."""
    events = 0
    if evict and leftovers:
        pool.remove(leftovers.popleft())
    stored = []
    for batch in round_batches(batches, round_index):
        decoded = decoder.decode(msgspec.msgpack.encode(batch))
        pool.apply(decoded.events)
        events += len(decoded.events)
        stored.extend(h for e in decoded.events if isinstance(e, STORED) for h in e.block_hashes)
    leftovers.append([h for h in stored if h in pool.slot_of])
    pool.take_journal()
    return events


# --- the report -----------------------------------------------------------------------------------

def report(rate: RateResult, memory: MemoryResult) -> str:
    keeps_up = rate.events_applied == rate.events_sent
    lines = [
        "kvscope bench attach: the attach client on events recorded from vLLM 0.32 (re-hashed rounds)",
        "",
        f"{'events/s asked':<28}{rate.rate:>14,.0f}",
        f"{'events/s applied':<28}{rate.achieved_rate:>14,.0f}   ({rate.events_applied:,} of {rate.events_sent:,}"
        f" sent: {'all' if keeps_up else 'NOT ALL'})",
        f"{'CPU, share of one core':<28}{rate.cpu_share:>14.1%}   (target under 20%; {rate.seconds:.1f} s, "
        f"{rate.frames} frames)",
        "",
        f"{'pool':<28}{memory.pool_blocks:>14,} blocks",
        f"{'events to fill it':<28}{memory.events_to_fill:>14,}   ({memory.known_after_fill:,} blocks known)",
        f"{'RSS before / filled':<28}{memory.rss_before_mib:>10,.0f} MiB / {memory.rss_after_fill_mib:,.0f} MiB",
        f"{'RSS after churning':<28}{memory.rss_after_churn_mib:>10,.0f} MiB   ({memory.events_churned:,} "
        f"more events: {memory.rss_after_churn_mib - memory.rss_after_fill_mib:+,.0f} MiB)",
        f"{'and after as many again':<28}{memory.rss_after_second_churn_mib:>10,.0f} MiB   "
        f"({memory.rss_after_second_churn_mib - memory.rss_after_churn_mib:+,.0f} MiB)",
        f"{'one frame of the pool':<28}{memory.frame_ms:>12.1f} ms",
    ]
    return "\n".join(lines)

