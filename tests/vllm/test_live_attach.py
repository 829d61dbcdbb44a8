"""kvscope attach against a live vLLM CPU server: its model of the server agrees with the server.

The data source runs as in the window (its own thread, /metrics every half
second, events as they come) while the OpenAI client sends the load of load.py.
Then, with the server idle, each chain of blocks the model holds is offered to
the server as a prompt: the server's own prefix cache answers how many of its
tokens it already holds, which is how many blocks of that chain it has cached.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import load
import msgspec
import pytest
import zmq

from kvscope.app.attach.feed.events import STORED, BatchDecoder
from kvscope.app.attach.feed.replay import request_replay
from kvscope.app.attach.feed.server import make_client, probe_server
from kvscope.app.attach.feed.source import AttachSource

MAX_PROBES = 12
EXTRA_TOKEN = 198   # a newline: a probe ends one token past the chain, so all of the chain can be a hit


def series(page: str, name: str) -> float:
    """A value read off the page by the test itself (one engine here)."""
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", page, re.MULTILINE)
    assert match, name
    return float(match.group(1))


class Attached:
    def __init__(self, server) -> None:
        self.server = server
        self.client = make_client()
        self.info, sample = probe_server(self.client, server.url)
        self.frames: list = []
        self.source = AttachSource(self.info, client=self.client, publish=self.frames.append, interval_s=0.5)
        self.thread = threading.Thread(target=self.source.run, args=(sample,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.source.stop()
        self.thread.join(10)
        self.client.close()

    def settle(self, timeout_s: float = 30.0) -> None:
        """Until the server is idle and two metrics samples later nothing moved."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            before = self.frames[-1]
            time.sleep(1.2)
            after = self.frames[-1]
            idle = after.queue_history and after.queue_history[-1].num_running == 0
            if idle and after.streams[0].last_seq == before.streams[0].last_seq and \
                    after.sample_index > before.sample_index:
                return
        raise TimeoutError("the server did not settle")

    @property
    def pool(self):
        return self.source.pools.pool(0, 0)


@pytest.fixture(scope="module")
def attached(vllm_server):
    attached = Attached(vllm_server)
    yield attached
    attached.close()


def test_probe_finds_the_pool_and_the_event_publisher(attached):
    info = attached.info
    assert (info.num_gpu_blocks, info.block_size, info.model) == (96, 32, "smollm2")
    assert info.version.startswith("0.32")
    (source,) = info.event_sources
    assert source.endpoint.endswith(f":{attached.server.events_port}") and not source.bind
    assert source.replay.endswith(f":{attached.server.replay_port}")


def test_the_model_follows_the_server_under_load(attached):
    client = load.client_for(attached.server.url)
    load.shared_phase(client)
    load.overload_phase(client)
    attached.settle()
    frames = [f for f in attached.frames if f.metrics is not None and f.metrics.text]
    assert frames
    for frame in frames:
        page, totals = frame.metrics.text, frame.metrics.totals()
        # running and waiting are the page's own, at the same sample
        assert frame.queue_history[-1].num_running == series(page, "vllm:num_requests_running") == \
            totals.num_running
        assert frame.queue_history[-1].num_waiting == series(page, "vllm:num_requests_waiting")
        queries, hits = series(page, "vllm:prefix_cache_queries_total"), series(page, "vllm:prefix_cache_hits_total")
        assert frame.rates.hit_rate == (hits / queries if queries else None)
        # the blocks known from events never exceed the pool
        assert all(pool.num_known_blocks <= attached.info.num_gpu_blocks for pool in frame.pools)
    assert max(f.queue_history[-1].num_waiting for f in frames) > 0       # the overload did overload
    last = attached.frames[-1]
    counters = last.pools[0].counters
    assert counters.num_removed > 0                                        # and evicted
    assert counters.num_overflow == counters.num_unknown_removed == 0
    assert last.streams[0].num_lost == last.streams[0].num_malformed == 0


def chains(attached) -> tuple[dict, list[list]]:
    """Every stored block's (parent, tokens) from the server's replay buffer, and the chain (root first) of
    each leaf the model holds."""
    context = zmq.Context()
    try:
        replay = request_replay(context, attached.info.event_sources[0].replay, 0, timeout_s=10)
    finally:
        context.term()
    assert replay.complete
    decoder, blocks = BatchDecoder(), {}
    for _, payload in replay.batches:
        for event in decoder.decode(payload).events:
            if isinstance(event, STORED):
                tokens = msgspec.msgpack.decode(event.token_ids)
                parent = event.parent_block_hash
                for index, block_hash in enumerate(event.block_hashes):
                    blocks.setdefault(block_hash, (parent, tokens[index * 32:(index + 1) * 32]))
                    parent = block_hash
    pool = attached.pool
    known = set(pool.slot_of)
    leaves = [h for h, slot in pool.slot_of.items() if pool.children_at[slot] == 0]
    evicted = [h for h in blocks if h not in known]
    result = []
    for leaf in leaves[:MAX_PROBES] + evicted[:4]:
        chain, block_hash = [], leaf
        while block_hash is not None and block_hash in blocks:
            chain.append(block_hash)
            block_hash = blocks[block_hash][0]
        if block_hash is None:   # reached a root: the server can be asked about the whole chain
            result.append(chain[::-1])
    return blocks, result


def test_the_blocks_known_from_events_are_the_servers_prefix_cache(attached):
    blocks, probes = chains(attached)
    assert probes
    client = load.client_for(attached.server.url)
    for chain in probes:
        attached.settle()
        known = set(attached.pool.slot_of)
        expected = next((i for i, h in enumerate(chain) if h not in known), len(chain))
        page = httpx.get(f"{attached.server.url}/metrics").text
        before = series(page, "vllm:prefix_cache_hits_total")
        prompt = [token for block_hash in chain for token in blocks[block_hash][1]] + [EXTRA_TOKEN]
        load.complete(client, prompt, max_tokens=1)
        after = series(httpx.get(f"{attached.server.url}/metrics").text, "vllm:prefix_cache_hits_total")
        assert after - before == expected * 32, f"the server holds {(after - before) / 32:.0f} of a chain " \
                                               f"of {len(chain)}, the model {expected}"
    attached.settle()
    # Stored minus removed (a block announced again counted once) is what the model holds.
    counters = attached.pool.counters
    assert attached.pool.num_known_blocks == counters.num_stored - counters.num_duplicates - counters.num_removed


def test_reset_prefix_cache_empties_the_map(attached):
    attached.settle()
    assert attached.frames[-1].pools[0].num_known_blocks > 0
    response = httpx.post(f"{attached.server.url}/reset_prefix_cache", timeout=30)
    assert response.status_code == 200
    # vLLM publishes AllBlocksCleared with the events of its next step: make one that fills no block.
    load.complete(load.client_for(attached.server.url), "Hello", max_tokens=4)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and attached.frames[-1].pools[0].counters.num_cleared == 0:
        time.sleep(0.1)
    pool = attached.frames[-1].pools[0]
    assert pool.counters.num_cleared == 1 and pool.num_known_blocks == 0 and pool.num_trees == 0
