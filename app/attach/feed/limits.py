"""What kvscope attach accepts from a server: the caps on what it reads and the checks on the numbers it reads.

Everything a server sends is input from outside. Each request has a total
deadline and a byte cap (fetch.py), each ZMQ message a size cap, each replay a
cap in batches and bytes, and each number that sizes something (blocks, block
size, ranks, label counts) a plausible range: ``pool_problem`` here, and
metrics.sample_problem for a whole /metrics page. A page that fails a check is
refused: in one line with exit status 2 before the window opens, and counted
and shown as a bad sample once it is running. The bounds are generous for any
real vLLM deployment and small enough that the worst a server can make kvscope
hold stays well under a gigabyte.
"""

from __future__ import annotations

# Requests.
METRICS_DEADLINE_S = 5.0            # GET /metrics, start to last byte
METRICS_MAX_BYTES = 8 << 20         # a real page is tens of kilobytes per engine
INFO_DEADLINE_S = 3.0               # GET /version, /v1/models, /kv_event_sources
INFO_MAX_BYTES = 1 << 20

# KV-event messages and replays.
MAX_MESSAGE_BYTES = 16 << 20        # a ZMQ message past it is dropped by libzmq (and the link reset)
REPLAY_MAX_BATCHES = 20_000         # vLLM buffers 10,000 steps by default
REPLAY_MAX_BYTES = 256 << 20
REPLAY_IDLE_S = 3.0                 # a replay with no reply for this long has ended
REPLAY_DEADLINE_S = 10.0            # and any replay ends after this, answered or not
REPLAY_COOLDOWN_S = 10.0            # after a replay that did not end well, gaps are counted, not asked for

# Numbers.
MAX_RANKS = 64                      # data-parallel ranks (engines, event sources, pools)
MAX_BLOCKS_PER_RANK = 1 << 22       # 4,194,304 blocks: ~180 MiB of pool model
MAX_BLOCKS = 1 << 23                # all ranks together
MAX_BLOCK_SIZE = 16_384             # tokens per block (the snapshot's fill column is int16)
MAX_REQUESTS = 10_000_000           # running or waiting at once
MAX_COUNT = 2.0 ** 53               # a counter (tokens, hits, preemptions) past this is not a count
MAX_BUCKETS = 256                   # histogram buckets
MAX_LABELS = 16                     # reasons kept per sample; the rest are summed into one row
MAX_UNKNOWN_KINDS = 16              # unknown event kinds named; the rest are counted together
MAX_TEXT = 200                      # characters kept of a server's name for a thing (model id, version, label)


def pool_problem(num_blocks: int | None, block_size: int | None, ranks: int = 1) -> str | None:
    """Why a pool of ``ranks`` x ``num_blocks`` blocks of ``block_size`` tokens cannot be drawn, or None."""
    if num_blocks is None or block_size is None:
        return "no num_gpu_blocks or block_size in vllm:cache_config_info (kvscope attach needs vLLM V1)"
    if not 1 <= num_blocks <= MAX_BLOCKS_PER_RANK:
        return f"num_gpu_blocks {num_blocks:,} is outside 1..{MAX_BLOCKS_PER_RANK:,}"
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        return f"block_size {block_size:,} is outside 1..{MAX_BLOCK_SIZE:,}"
    if not 1 <= ranks <= MAX_RANKS:
        return f"{ranks:,} engines is outside 1..{MAX_RANKS}"
    if num_blocks * ranks > MAX_BLOCKS:
        return f"{ranks} engines x {num_blocks:,} blocks is more than {MAX_BLOCKS:,} in all"
    return None
