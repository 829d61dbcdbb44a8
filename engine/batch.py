"""The contract between the scheduler and the model runner: what to compute this step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvscope.engine.config import SamplingParams


@dataclass(slots=True, eq=False, weakref_slot=True)
class SamplingContext:
    """What the sampler reads, beyond a row's logits, for a request whose params.reads_more_than_logits: its
    samples' token lists (the live lists, prompt then output, never copied), the stop tokens min_tokens holds back,
    the bad words as token ids, a compiled grammar, and whatever the runner keeps for the request between steps
    (``runner_state``: device rows of token counts, grammar matchers), which goes when the request goes. A request
    without such knobs has none, and its rows skip all of that."""

    params: SamplingParams
    token_lists: list[list[int]]
    num_prompt_tokens: int
    stop_token_ids: frozenset[int]
    bad_words: tuple[tuple[int, ...], ...] = ()
    grammar: object = None
    runner_state: object = None


class BatchItem(NamedTuple):
    """One sequence's share of a step: a prefill chunk or a single decode token.

    The runner writes K/V for ``token_ids`` at positions ``start_pos ..`` into the
    slots that ``block_table`` maps them to, attends over the whole context
    (``start_pos + len(token_ids)`` tokens), and when ``sample_indices`` is
    non-empty samples one next token per listed sample from the last position.
    """

    seq_id: int
    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample_indices: tuple[int, ...]    # () mid-prefill; (k,) decode of sample k; (0..n-1) when an n>1 prompt completes
    params: SamplingParams
    # With KV-cache groups: each group's table (Sequence.group_tables), and block_table is every block held.
    group_tables: tuple[tuple[int, ...], ...] = ()
    sampling: SamplingContext | None = None    # None: the row's logits are all its sampling reads

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class ScheduledBatch:
    items: tuple[BatchItem, ...]
    # Cache moves the runner performs before the forward, in this order:
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()   # (device block, host block)
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()    # (host block, device block)
    blocks_to_copy: tuple[tuple[int, int], ...] = ()       # (src device block, dst device block), copy-on-write
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted_request_ids: tuple[str, ...] = field(default_factory=tuple)
