"""Immutable results of one engine step. Safe to hand to another thread.

The snapshot keeps per-block state in small read-only numpy arrays, so taking
one every step is a handful of array copies, not thousands of Python objects.

The records made once per request per step (outputs, views, metrics, events)
are NamedTuples: as immutable as a frozen dataclass, but built in a third of
the time, which matters at 256 requests a step. Per-step records stay
dataclasses.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvscope.engine.block_changes import BlockArrays
from kvscope.engine.kv_cache_groups import KVCacheGroup

if TYPE_CHECKING:
    from kvscope.engine.request_columns import CapturedViews

# Values of CacheSnapshot.block_state.
BLOCK_FREE = 0      # ref count 0, holds no cached prefix
BLOCK_USED = 1      # ref count >= 1
BLOCK_CACHED = 2    # ref count 0 but still holds a prefix hash: reusable until evicted
# A group table entry whose block a sliding window gave back (RequestView.group_block_tables); engine/block_pool.py
# says what the engine does with it.
NULL_BLOCK = -1


class _StrEnum(str, Enum):
    """Members are their own string values: they compare equal to, print as and store as plain strings,
    so the run log stays readable and code comparing with "running" keeps working. (enum.StrEnum is
    Python 3.11+; this is the same for 3.10.) Never read ``.value`` on the hot path: it is a property."""

    __str__ = str.__str__
    __format__ = str.__format__


class RequestStatus(_StrEnum):
    """A request's queue: RequestView.queue holds one of the first three."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(_StrEnum):
    STOP = "stop"           # an EOS or stop token, or a stop string
    LENGTH = "length"       # max_tokens, or max_model_len
    ABORT = "abort"         # abort_request
    ERROR = "error"         # the model runner failed for this request, or the step failed; see .error


class RequestMetrics(NamedTuple):
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class TokenIds(Sequence):
    """A sample's output token ids as they stood when an output was made: a window on the sample's own token
    list, which only ever grows at its end, so building one costs the same after 4,000 tokens as after one.
    It reads as a tuple (compares equal to one, slices into one); tuple(ids) copies it out. Log-probabilities,
    which grow the same way, use the same window."""

    __slots__ = ("_ids", "_start", "_stop")

    def __init__(self, ids: list[int], start: int, stop: int | None = None) -> None:
        self._ids, self._start, self._stop = ids, start, len(ids) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self._ids[self._start:self._stop][index])
        if not -len(self) <= index < len(self):
            raise IndexError("token index out of range")
        return self._ids[(self._stop if index < 0 else self._start) + index]

    def __iter__(self):
        return iter(self._ids[self._start:self._stop])

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, list, TokenIds)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other):
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return repr(tuple(self))


class TokenLogprob(NamedTuple):
    """One token's log-probability under the model (fp32 log-softmax of the logits the sampler decided on,
    before penalties, bias and temperature), its rank there (1: the most likely), and the ``top`` most likely
    tokens with theirs, best first: as many as the request asked for."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class SampleOutput(NamedTuple):
    index: int
    token_ids: TokenIds                 # the whole output so far
    text: str
    finish_reason: FinishReason | None
    logprobs: Sequence[TokenLogprob] | None = None    # one per output token, when SamplingParams.logprobs asks


class RequestOutput(NamedTuple):
    request_id: str
    prompt_token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]      # sample 0's tokens produced by this step
    text_delta: str                     # sample 0's text produced by this step
    token_ids: TokenIds                 # sample 0's whole output so far
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int
    num_preemptions: int
    metrics: RequestMetrics
    samples: tuple[SampleOutput, ...]
    error: str | None = None            # set when finish_reason == "error"
    # When SamplingParams.prompt_logprobs asks: one per prompt token computed so far, None for the first.
    prompt_logprobs: Sequence[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class StepStats:
    step: int
    time: float                         # wall-clock (time.time()) at the end of the step
    duration: float                     # seconds spent in step()
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int                # includes cached-free blocks
    num_cached_free_blocks: int
    num_total_blocks: int
    kv_usage: float                     # used blocks / total
    kv_token_utilisation: float         # tokens held / slots allocated (reserved, for contiguous)
    prefix_cache_queries: int           # cumulative, in tokens
    prefix_cache_hits: int              # cumulative, in tokens
    num_preemptions: int                # cumulative
    num_swapped_out_blocks: int         # cumulative
    num_swapped_in_blocks: int          # cumulative
    prompt_tokens_per_s: float          # this step
    generation_tokens_per_s: float      # this step
    num_generated_tokens: int = 0       # this step: tokens sampled, every sample's (a watched server: counted by it)
    forward_duration: float = 0.0       # seconds of the step spent in the model runner (execute)
    # The rest of duration, by phase: schedule(), update_from_output() plus building the outputs, and the
    # snapshot with these stats. Wall-clock seconds, for the bench and anyone asking where a step went.
    schedule_duration: float = 0.0
    update_duration: float = 0.0
    snapshot_duration: float = 0.0
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    num_copy_on_write_blocks: int = 0   # cumulative: blocks copied before a sample wrote into a shared one
    num_evicted_blocks: int = 0         # cumulative: cached prefix blocks dropped to make room
    # With KV-cache groups (kv_cache_groups on the snapshot), one entry per group: device blocks its tables hold,
    # and block-table entries its sliding window let go of as requests advanced (cumulative, and this step; always
    # 0 for a full-attention group). Empty with one group.
    group_held_blocks: tuple[int, ...] = ()
    window_freed_blocks: tuple[int, ...] = ()
    window_freed_step: tuple[int, ...] = ()


class RequestView(NamedTuple):
    """One request as the block map and the queue tables see it."""

    request_id: str
    queue: RequestStatus                # RUNNING | WAITING | SWAPPED
    arrival_index: int                  # stable per engine; drives the request's colour
    # One per live sample; device blocks. With one sample and one KV-cache group a request's table only grows
    # (each step's extends the last) until it is preempted (num_preemptions): the engine process's wire sends
    # tables by that promise (app/worker/wire.py), and the invariant tests hold the engine to it.
    block_tables: tuple[tuple[int, ...], ...]
    host_block_tables: tuple[tuple[int, ...], ...]  # swapped out: blocks in the host pool
    num_prompt_tokens: int
    num_output_tokens: int              # sample 0
    max_tokens: int
    num_computed_tokens: int            # sample 0
    num_cached_tokens: int
    num_preemptions: int
    num_samples: int
    reserved_slots: int                 # slots the allocator holds for this request
    used_slots: int                     # slots holding real tokens
    prompt_preview: str = ""
    # With KV-cache groups: per live sample, its table in each group (-1 where a sliding window freed a block);
    # block_tables then hold every block a sample holds, group after group. Empty with one group.
    group_block_tables: tuple[tuple[tuple[int, ...], ...], ...] = ()


def view_columns(views, names: tuple[str, ...]) -> list[list]:
    """RequestView's fields ``names`` of ``views``, a list each."""
    return [list(map(operator.itemgetter(RequestView._fields.index(name)), views)) for name in names]


def _block_array(index: int) -> property:
    return property(lambda snapshot: snapshot.blocks.arrays()[index])


@dataclass(frozen=True, init=False)
class CacheSnapshot:
    """The pool and the queues after a step. The four per-block arrays (block_state, ref_counts, block_fill,
    block_hashes: read-only) are built on first access from ``blocks``, whose ``changes`` say which blocks this
    step changed (engine/block_changes.py); give them whole instead to make a snapshot by hand."""

    step: int
    block_size: int
    num_blocks: int
    allocator: str                      # "paged" | "contiguous"
    blocks: BlockArrays
    # A field read through a property: a step's views are built on first read (engine/request_columns.py).
    requests: tuple[RequestView, ...] = property(lambda snapshot: snapshot._requests if type(snapshot._requests)
                                                 is tuple else snapshot._requests.views())
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()     # empty: one group, every layer full

    def __init__(self, step: int, block_size: int, num_blocks: int, allocator: str,
                 block_state: np.ndarray | None = None,     # int8 [num_blocks], BLOCK_* values
                 ref_counts: np.ndarray | None = None,      # int32 [num_blocks]
                 block_fill: np.ndarray | None = None,      # int16 [num_blocks], token slots written
                 block_hashes: np.ndarray | None = None,    # uint64 [num_blocks], 0 = no cached hash
                 requests: tuple[RequestView, ...] | CapturedViews = (), num_host_blocks: int = 0,
                 num_free_host_blocks: int = 0, blocks: BlockArrays | None = None,
                 kv_cache_groups: tuple[KVCacheGroup, ...] = ()) -> None:
        given = (block_state, ref_counts, block_fill, block_hashes)
        if blocks is None or any(a is not None for a in given):
            base = blocks.arrays() if blocks is not None else (None,) * 4
            blocks = BlockArrays.whole(a if a is not None else b for a, b in zip(given, base, strict=True))
        for name, value in (("step", step), ("block_size", block_size), ("num_blocks", num_blocks),
                            ("allocator", allocator), ("blocks", blocks),
                            ("_requests", requests if hasattr(requests, "views") else tuple(requests)),
                            ("num_host_blocks", num_host_blocks), ("num_free_host_blocks", num_free_host_blocks),
                            ("kv_cache_groups", tuple(kv_cache_groups))):
            object.__setattr__(self, name, value)

    def without_requests(self) -> CacheSnapshot:
        """The same snapshot with no request views: what a consumer that only follows the blocks keeps."""
        bare = object.__new__(CacheSnapshot)
        vars(bare).update(vars(self), _requests=())
        return bare

    @property
    def num_requests(self) -> int:
        """len(requests), without building a step's views."""
        return len(self._requests)

    def request_columns(self, names: tuple[str, ...]) -> list[list]:
        """RequestView's fields ``names`` of every request, a list each in ``requests`` order; a step's views are
        not built for it."""
        source = self._requests
        return view_columns(source, names) if type(source) is tuple else source.columns(names)

    block_state = _block_array(0)
    ref_counts = _block_array(1)
    block_fill = _block_array(2)
    block_hashes = _block_array(3)

    def owners(self, block_id: int) -> list[tuple[str, int, int]]:
        """(request id, sample index, logical index) for each table entry pointing at block_id; with KV-cache
        groups the logical index is in the block's group's table (block_group names the group)."""
        found = []
        for req in self.requests:
            for sample, tables in enumerate(req.group_block_tables or [(table,) for table in req.block_tables]):
                for table in tables:
                    for logical, physical in enumerate(table):
                        if physical == block_id:
                            found.append((req.request_id, sample, logical))
        return found

    def block_group(self, block_id: int) -> int | None:
        """The KV-cache group whose table holds block_id (None with one group, or for a block nobody holds)."""
        for req in self.requests:
            for tables in req.group_block_tables:
                for group, table in enumerate(tables):
                    if block_id in table:
                        return group
        return None

    def group_label(self, group: int) -> str:
        """How the window and the block table name a group: "full" or "sliding 512", with its layers."""
        spec = self.kv_cache_groups[group]
        kind = "full" if spec.sliding_window is None else f"sliding {spec.sliding_window}"
        layers = ",".join(map(str, spec.layers))
        return f"group {group} ({kind}, layer{'s' if len(spec.layers) > 1 else ''} {layers})"

    def owner_index(self) -> np.ndarray:
        """int32 [num_blocks]: arrival_index of a block's (first) owner, -1 where unowned."""
        owner = np.full(self.num_blocks, -1, dtype=np.int32)
        for req in reversed(self.requests):
            for table in req.block_tables:
                if table:
                    owner[list(table)] = req.arrival_index
        return owner


class BlockStored(NamedTuple):
    """A full block entered the prefix cache: a request whose tokens start with the same chain of blocks can
    now reuse it. One event per block, in the order the blocks were cached; a block whose prefix another
    block already holds is not cached, and gets no event."""

    block_hash: int                     # non-zero; hash_block(parent_block_hash or 0, token_ids)
    parent_block_hash: int | None       # the previous block's hash in the chain; None for a first block
    token_ids: tuple[int, ...]          # the block's block_size tokens
    block_size: int
    block_id: int                       # the device block holding it (vLLM's events name no physical block)


class BlockRemoved(NamedTuple):
    """A block's prefix left the prefix cache: its block was taken for new tokens (an eviction), or a failed
    step dropped it because it may be half written."""

    block_hash: int
    block_id: int


class AllBlocksCleared(NamedTuple):
    """Every cached prefix was dropped at once (LLMEngine.reset_prefix_cache)."""


# The prefix cache's changes, as vLLM's KV-cache events (vllm.distributed.kv_events) describe them: replayed in
# order from an empty cache, they give exactly the (block_hash, block_id) pairs cached after the step.
KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class StepResult:
    outputs: list[RequestOutput]
    stats: StepStats
    snapshot: CacheSnapshot
    events: tuple[EngineEvent, ...] = ()
    # What happened to the prefix cache since the previous StepResult, oldest first; with the events of a step
    # that raised, and of reset_prefix_cache() calls between steps. Empty without prefix caching.
    kv_events: tuple[KVCacheEvent, ...] = ()

    @classmethod
    def knowing_finished(cls, finished: list[RequestOutput], *fields) -> StepResult:
        """A result whose maker knew, as it made the outputs, which finished (the engine does): ``finished``, in
        output order, spares finished_outputs its pass over a big batch's outputs."""
        result = cls(*fields)
        vars(result)["_finished_outputs"] = finished
        return result

    @property
    def finished_outputs(self) -> list[RequestOutput]:
        """The outputs of the requests that finished in this step (not to be changed): the run log and the app's
        worker ask each step. Found once, whoever asks first, where the maker did not say (knowing_finished).
        Kept beside the fields by hand: functools.cached_property takes a lock on every first read on Python
        3.11."""
        found = vars(self).get("_finished_outputs")
        if found is None:   # two threads that both look first make the same list
            found = vars(self)["_finished_outputs"] = [output for output in self.outputs if output.finished]
        return found


class EventKind(_StrEnum):
    """What an EngineEvent reports. A str enum, so run logs written with plain strings read back the same."""

    PREEMPT = "preempt"                 # detail: "swap", "recompute" or "recompute (host pool full)"
    SWAP_OUT = "swap_out"
    SWAP_IN = "swap_in"
    EVICT = "evict"                     # blocks: cached prefixes the request's allocation took
    COPY_ON_WRITE = "copy_on_write"     # blocks: (source, copy); detail: "sample k"
    ABORT = "abort"
    ERROR = "error"                     # detail: why
    FINISH = "finish"                   # detail: the finish reason
    # Recorded by `kvscope attach` for a watched vLLM server:
    NOTICE = "notice"                   # detail: what the attach source noticed
    KV_STORED = "kv_stored"             # blocks: the pool view's slots of blocks the server announced
    KV_REMOVED = "kv_removed"
    KV_CLEARED = "kv_cleared"


class EngineEvent(NamedTuple):
    """Something the run log and the UI want to know about, beyond the counters."""

    kind: EventKind
    request_id: str | None
    blocks: tuple[int, ...] = ()
    detail: str = ""


@dataclass(frozen=True)
class KVLayout:
    """What one token's keys and values take in the pool, from the model's own config: what a KV cache is
    sized by (the sizing lesson works it out on screen, as vLLM does before it prints its concurrency)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int              # of the cache's dtype: 4 for float32, 2 for bfloat16 and float16

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes    # K and V
