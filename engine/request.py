"""A request (sequence group) and its samples (sequences): the engine's mutable bookkeeping.

A request with ``n > 1`` owns ``n`` sequences from the start, but only sample 0
runs the prompt. When the prompt completes, the other samples fork from it:
they share its blocks (copy-on-write) and each gets its own first token.
"""

from __future__ import annotations

import itertools

from kvscope.engine.config import SamplingParams
from kvscope.engine.detokenizer import IncrementalDetokenizer
from kvscope.engine.outputs import RequestMetrics, RequestView


class RequestStatus:
    """A request's queue, as the plain strings RequestView.queue reports (an Enum's .value is slow)."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """One sample: its tokens, how many of them are in the KV cache, and where they live."""

    __slots__ = ("seq_id", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens", "block_table",
                 "host_block_table", "block_hashes", "finish_reason", "detokenizer", "_table_tuple")

    def __init__(self, index: int, prompt_token_ids: list[int], detokenizer: IncrementalDetokenizer | None):
        self.seq_id = next(_seq_ids)
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0        # tokens whose K/V are in the cache
        self.block_table: list[int] = []    # device blocks, logical order
        self.host_block_table: list[int] = []   # host blocks while swapped out
        self.block_hashes: list[int] = []   # prefix-cache hash of each full block, as far as computed
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        self._table_tuple: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def table_tuple(self) -> tuple[int, ...]:
        """The block table as a tuple, rebuilt only after the table changed (every block_size tokens)."""
        if self._table_tuple is None:
            self._table_tuple = tuple(self.block_table)
        return self._table_tuple

    def table_changed(self) -> None:
        self._table_tuple = None


class Request:
    """A sequence group: one prompt, its sampling parameters and ``params.n`` samples."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int, arrival_time: float, tokenizer=None, prompt_preview: str = "",
                 stop_token_ids: frozenset[int] = frozenset(), max_num_tokens: int | None = None):
        self.request_id = request_id
        # The stop rules, resolved once: a sample stops on any of these tokens, or at this length.
        self.stop_token_ids = stop_token_ids
        self.max_num_tokens = max_num_tokens or len(prompt_token_ids) + params.max_tokens
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.params = params
        self.arrival_index = arrival_index
        self.prompt_preview = prompt_preview
        self.status: str = RequestStatus.WAITING
        self.seqs = [Sequence(k, prompt_token_ids, _detokenizer(tokenizer, prompt_token_ids, params))
                     for k in range(params.n)]
        self.forked = params.n == 1     # samples 1..n-1 exist only after the prompt completes
        self.num_preemptions = 0
        self.num_cached_tokens = 0
        self.admitted = False           # first admission done (num_cached_tokens is final)
        self.error: str | None = None
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self._metrics: RequestMetrics | None = None
        self.view: RequestView | None = None   # cached snapshot view; None when stale

    def schedulable_seqs(self) -> list[Sequence]:
        """Samples that run this step: sample 0 until the fork, then every unfinished sample."""
        if len(self.seqs) == 1:
            return self.seqs    # n == 1: the request finishes with its only sample
        if not self.forked:
            return self.seqs[:1]
        return [seq for seq in self.seqs if seq.finish_reason is None]

    def live_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if seq.finish_reason is None]

    def metrics(self) -> RequestMetrics:
        cached = self._metrics
        if (cached is None or cached.first_scheduled_time != self.first_scheduled_time
                or cached.first_token_time != self.first_token_time
                or cached.finished_time != self.finished_time):
            cached = self._metrics = RequestMetrics(self.arrival_time, self.first_scheduled_time,
                                                    self.first_token_time, self.finished_time)
        return cached


def _detokenizer(tokenizer, prompt_token_ids: list[int], params: SamplingParams):
    if tokenizer is None or not params.detokenize:
        return None
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop)
