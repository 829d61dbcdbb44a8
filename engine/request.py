"""A request (sequence group) and its samples (sequences): the engine's mutable bookkeeping.

A request with ``n > 1`` owns ``n`` sequences from the start, but only sample 0
runs the prompt. When the prompt completes, the other samples fork from it:
they share its blocks (copy-on-write) and each gets its own first token.
"""

from __future__ import annotations

import itertools

from kvscope.engine.batch import SamplingContext
from kvscope.engine.config import SamplingParams
from kvscope.engine.detokenizer import IncrementalDetokenizer
from kvscope.engine.outputs import (
    FinishReason,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    RequestView,
    SampleOutput,
    TokenIds,
    TokenLogprob,
)

__all__ = ["Request", "RequestStatus", "Sequence"]


_seq_ids = itertools.count()
_new_tuple = tuple.__new__
_FINISHED = RequestStatus.FINISHED  # looked up once: an enum member's lookup through its class costs ~5x a global


class Sequence:
    """One sample: its tokens, how many of them are in the KV cache, and where they live."""

    __slots__ = ("seq_id", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens", "block_table",
                 "host_block_table", "group_tables", "host_group_tables", "block_hashes", "finish_reason",
                 "detokenizer", "logprobs")

    def __init__(self, index: int, prompt_token_ids: list[int], detokenizer: IncrementalDetokenizer | None):
        self.seq_id = next(_seq_ids)
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0        # tokens whose K/V are in the cache
        # Device blocks in logical order, and host blocks while swapped out. Tuples, replaced whole on every
        # change: a batch item or a snapshot view can hold one without copying, and it never goes stale.
        self.block_table: tuple[int, ...] = ()
        self.host_block_table: tuple[int, ...] = ()
        # With KV-cache groups (engine/kv_cache_groups.py): one table per group, NULL_BLOCK where a sliding
        # window freed a block; block_table and host_block_table are then every block held, group after group.
        # Empty for a model with one group.
        self.group_tables: tuple[tuple[int, ...], ...] = ()
        self.host_group_tables: tuple[tuple[int, ...], ...] = ()
        self.block_hashes: list[int] = []   # prefix-cache hash of each full block, as far as computed
        self.finish_reason: FinishReason | None = None
        self.detokenizer = detokenizer
        self.logprobs: list[TokenLogprob] | None = None   # one per output token, when the request asks

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def finish(self, reason: FinishReason, by_stop_string: bool = False) -> None:
        """The sample is done: release the rest of its text. Its blocks are the KV cache manager's to free."""
        self.finish_reason = reason
        if self.detokenizer is not None:
            self.detokenizer.finish(by_stop_string)


class Request:
    """A sequence group: one prompt, its sampling parameters and ``params.n`` samples."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int, arrival_time: float, tokenizer=None, prompt_preview: str = "",
                 stop_token_ids: frozenset[int] = frozenset(), max_num_tokens: int | None = None,
                 bad_words: tuple[tuple[int, ...], ...] = (), grammar=None):
        self.request_id = request_id
        # The stop rules, resolved once: a sample stops on any of these tokens, or at this length.
        self.stop_token_ids = stop_token_ids
        self.max_num_tokens = max_num_tokens or len(prompt_token_ids) + params.max_tokens
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.params = params
        self.arrival_index = arrival_index
        # The window's queues show a constrained request as such, ahead of its prompt.
        self.prompt_preview = prompt_preview if params.structured_output is None else \
            f"{{{params.structured_output[0].replace('_', ' ')}}} {prompt_preview}"
        self.status = RequestStatus.WAITING
        self.seqs = [Sequence(k, prompt_token_ids, _detokenizer(tokenizer, prompt_token_ids, params))
                     for k in range(params.n)]
        self.forked = params.n == 1     # samples 1..n-1 exist only after the prompt completes
        self.sampling: SamplingContext | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.reads_prefix_cache = params.prompt_logprobs is None    # a cached prefix would have no logits
        if params.reads_more_than_logits:
            self.sampling = SamplingContext(params, [seq.token_ids for seq in self.seqs], len(prompt_token_ids),
                                            stop_token_ids, bad_words, grammar)
            for seq in self.seqs if params.logprobs is not None else ():
                seq.logprobs = []
            if params.prompt_logprobs is not None:
                self.prompt_logprobs = [None]   # the first token has nothing before it
        self.num_preemptions = 0
        self.num_cached_tokens = 0
        self.admitted = False           # first admission done (num_cached_tokens is final)
        self.error: str | None = None   # why it finished with FinishReason.ERROR
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self._metrics: RequestMetrics | None = None
        # The snapshot's view of this request, reused while nothing about it changed. The scheduler clears it
        # for the requests a step scheduled or preempted, once per step (update_from_output, or fail_step):
        # no other request's state changes in a step.
        self.view: RequestView | None = None

    def schedulable_seqs(self) -> list[Sequence]:
        """Samples that run this step: sample 0 until the fork, then every unfinished sample."""
        if len(self.seqs) == 1:
            return self.seqs    # n == 1: the request finishes with its only sample
        if not self.forked:
            return self.seqs[:1]
        return [seq for seq in self.seqs if seq.finish_reason is None]

    def live_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if seq.finish_reason is None]

    def device_blocks(self) -> tuple[int, ...]:
        """Every device block table entry of every sample (a shared block once per sample holding it)."""
        return tuple(block for seq in self.seqs for block in seq.block_table)

    def append_token(self, seq: Sequence, token: int, now: float) -> bool:
        """Add a sampled token to one sample and apply the stop rules; True when that sample finished."""
        token_ids = seq.token_ids
        token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        detokenizer = seq.detokenizer
        if detokenizer is not None and detokenizer.add_token(token):
            seq.finish(FinishReason.STOP, by_stop_string=True)
        elif token in self.stop_token_ids:
            seq.finish(FinishReason.STOP)
        elif len(token_ids) >= self.max_num_tokens:
            seq.finish(FinishReason.LENGTH)
        else:
            return False
        return True

    def record_logprobs(self, sample_indices: tuple[int, ...], found) -> None:
        """Keep a step's log-probabilities (engine.runner.ItemLogprobs), before its tokens are appended: a
        sampled token's go with its sample; prompt ones a recompute after preemption computes again are known."""
        for sample_index, logprob in zip(sample_indices, found.sampled):
            self.seqs[sample_index].logprobs.append(logprob)
        known = self.prompt_logprobs
        if known is not None:
            skip = len(known) - found.prompt_start
            if skip >= 0:
                known.extend(found.prompt[skip:])

    def output(self, new_token_ids: tuple[int, ...]) -> RequestOutput:
        """What the request reports after a step that gave sample 0 ``new_token_ids``; takes the text delta."""
        seqs = self.seqs
        first = seqs[0]
        detokenizer = first.detokenizer
        if detokenizer is None:
            delta = text = ""
        else:   # detokenizer.take(), inline: this runs for every request every step
            text, released, taken = detokenizer.text, detokenizer.released, detokenizer.taken
            delta = text[taken:released] if released != taken else ""
            detokenizer.taken = released
            if released != len(text):
                text = text[:released]
        logprobs = first.logprobs
        token_ids = TokenIds(first.token_ids, first.num_prompt_tokens)
        # tuple.__new__ with the fields in order, and sample 0's built here rather than by _sample_output: this
        # runs for every request every step, and a NamedTuple's own constructor (a Python function) costs twice
        # as much.
        sample = _new_tuple(SampleOutput, (first.index, token_ids, text, first.finish_reason,
                                           None if logprobs is None else TokenIds(logprobs, 0)))
        samples = (sample,) if len(seqs) == 1 else (sample, *map(_sample_output, seqs[1:]))
        metrics = self._metrics
        # The first scheduling and first token times are set once, the first before the second, so metrics holding
        # a first token time stay right until the request finishes.
        if metrics is None or metrics[2] is None or self.finished_time is not None:
            metrics = self._metrics = RequestMetrics(self.arrival_time, self.first_scheduled_time,
                                                     self.first_token_time, self.finished_time)
        return _new_tuple(RequestOutput, (
            self.request_id, self.prompt_token_ids, new_token_ids, delta, token_ids, text,
            self.status is _FINISHED, first.finish_reason, self.num_cached_tokens, self.num_preemptions, metrics,
            samples, self.error, None if self.prompt_logprobs is None else TokenIds(self.prompt_logprobs, 0)))


def _sample_output(seq: Sequence) -> SampleOutput:
    detokenizer = seq.detokenizer
    logprobs = seq.logprobs
    return _new_tuple(SampleOutput, (seq.index, TokenIds(seq.token_ids, seq.num_prompt_tokens),
                                     detokenizer.output_text if detokenizer else "", seq.finish_reason,
                                     None if logprobs is None else TokenIds(logprobs, 0)))


def _detokenizer(tokenizer, prompt_token_ids: list[int], params: SamplingParams):
    if tokenizer is None or not params.detokenize:
        return None
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop, params.min_tokens)
