"""What the sampler does to the rows of requests with more than plain sampling (engine.batch.SamplingContext):
their log-probabilities, the penalties, logit bias, bad words, min_tokens and a grammar's mask. Rows without
such a request never come here.

Penalties read each sample's token counts. Those are kept on the logits' device across steps, in two tables with
a row per sample: the count of each output token, and a mark per prompt token. A step adds only the tokens that
are new since the last one (one scattered add for the whole batch), so its cost does not grow with the tokens a
request has generated; a table row goes back to the free list when its request goes.

Order, as vLLM's: bias and bans (bad words, min_tokens, the grammar), then the penalties; temperature, min-p,
top-k and top-p follow in the sampler. Log-probabilities are of the raw logits, before any of it (vLLM's
default), so they say what the model itself thinks of each token.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import numpy as np
import torch

from kvscope.engine.batch import SamplingContext
from kvscope.engine.outputs import TokenLogprob

_FIRST_TABLE_ROWS = 16
_PROMPT_LOGPROB_SLICE = 256     # prompt positions turned into log-probabilities at once: bounds the memory


class ContextRow(NamedTuple):
    row: int                    # the row of the logits
    context: SamplingContext
    sample_index: int


class _RequestState:
    """The runner's part of one request (SamplingContext.runner_state)."""

    __slots__ = ("table_rows", "counted", "released", "matchers", "pending_prompt_row")

    def __init__(self, n: int) -> None:
        self.table_rows = [-1] * n      # -1: no penalty-table row yet
        self.counted = [0] * n          # output tokens of each sample already in its table row
        self.released = False           # the rows go back to the tables when the request goes
        self.matchers: list | None = None
        # (position, log-softmax there) at the end of a prompt chunk: the next chunk has its target.
        self.pending_prompt_row: tuple[int, torch.Tensor] | None = None


def _state(context: SamplingContext) -> _RequestState:
    state = context.runner_state
    if state is None:
        state = context.runner_state = _RequestState(len(context.token_lists))
        if context.grammar is not None:
            state.matchers = [context.grammar.matcher() for _ in context.token_lists]
    return state


def _has_penalty(params) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


class LogitsProcessor:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.counts: torch.Tensor | None = None      # [rows, vocab] float32: output token counts
        self.in_prompt: torch.Tensor | None = None   # [rows, vocab] bool: prompt tokens
        self._free: list[int] = []

    # ---- the penalty tables ----------------------------------------------------------------------------

    def _table_row(self, state: _RequestState, sample_index: int, context: SamplingContext, device) -> int:
        row = state.table_rows[sample_index]
        if row >= 0:
            return row
        if not self._free:
            self._grow(device)
        row = state.table_rows[sample_index] = self._free.pop()
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        prompt = context.token_lists[sample_index][:context.num_prompt_tokens]
        self.in_prompt[row, torch.tensor(prompt, dtype=torch.int64, device=device)] = True
        state.counted[sample_index] = 0
        if not state.released:
            state.released = True
            weakref.finalize(context, self._release, state.table_rows)
        return row

    def _grow(self, device) -> None:
        old = 0 if self.counts is None else self.counts.shape[0]
        new = max(_FIRST_TABLE_ROWS, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=device)
        if old:
            counts[:old] = self.counts
            in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))

    def _release(self, table_rows: list[int]) -> None:
        self._free.extend(row for row in table_rows if row >= 0)

    @property
    def rows_in_use(self) -> int:
        return (0 if self.counts is None else self.counts.shape[0]) - len(self._free)

    # ---- before the draw ---------------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, rows: list[ContextRow]) -> None:
        """Bias, bans and penalties on ``logits`` (fp32 [batch, vocab]) in place, for the listed rows."""
        device = logits.device
        penalized: list[tuple[int, int, object]] = []
        new_rows: list[int] = []
        new_tokens: list[int] = []
        bias: tuple[list, list, list] = ([], [], [])
        banned: tuple[list, list] = ([], [])
        allowed: list[tuple[int, np.ndarray]] = []
        for row, context, sample_index in rows:
            params = context.params
            state = _state(context)
            tokens = context.token_lists[sample_index]
            num_prompt = context.num_prompt_tokens
            num_output = len(tokens) - num_prompt
            if _has_penalty(params):
                table_row = self._table_row(state, sample_index, context, device)
                fresh = tokens[num_prompt + state.counted[sample_index]:]
                new_rows.extend([table_row] * len(fresh))
                new_tokens.extend(fresh)
                state.counted[sample_index] = num_output
                penalized.append((row, table_row, params))
            if params.logit_bias:
                bias[0].extend([row] * len(params.logit_bias))
                bias[1].extend(params.logit_bias)
                bias[2].extend(params.logit_bias.values())
            if num_output < params.min_tokens:
                banned[0].extend([row] * len(context.stop_token_ids))
                banned[1].extend(context.stop_token_ids)
            for word in context.bad_words:
                before = len(word) - 1
                if before == 0 or (num_output >= before and tokens[-before:] == list(word[:-1])):
                    banned[0].append(row)
                    banned[1].append(word[-1])
            if state.matchers is not None:
                allowed.append((row, state.matchers[sample_index].allowed()))
        if bias[0]:
            logits.index_put_(_indices(bias[0], bias[1], device),
                              torch.tensor(bias[2], dtype=torch.float32, device=device), accumulate=True)
        if banned[0]:
            logits[_indices(banned[0], banned[1], device)] = float("-inf")
        if allowed:
            index = torch.tensor([row for row, _ in allowed], dtype=torch.int64, device=device)
            mask = torch.from_numpy(np.stack([a for _, a in allowed])).to(device)
            logits[index] = logits[index].masked_fill(~mask, float("-inf"))
        if new_rows:
            self.counts.index_put_(_indices(new_rows, new_tokens, device),
                                   torch.ones(len(new_rows), dtype=torch.float32, device=device), accumulate=True)
        if penalized:
            self._penalize(logits, penalized)

    def _penalize(self, logits: torch.Tensor, penalized: list[tuple[int, int, object]]) -> None:
        device = logits.device
        index = torch.tensor([row for row, _, _ in penalized], dtype=torch.int64, device=device)
        table = torch.tensor([t for _, t, _ in penalized], dtype=torch.int64, device=device)

        def per_row(name: str) -> torch.Tensor:
            values = [getattr(params, name) for _, _, params in penalized]
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

        part = logits[index]
        counts = self.counts[table]
        in_output = counts > 0
        repetition = per_row("repetition_penalty")
        if bool((repetition != 1.0).any()):
            # transformers' rule: a seen token's logit is divided by the penalty when positive, multiplied when not.
            seen = self.in_prompt[table] | in_output
            part = torch.where(seen, torch.where(part < 0, part * repetition, part / repetition), part)
        part = part - counts * per_row("frequency_penalty") - in_output * per_row("presence_penalty")
        logits[index] = part

    # ---- after the draw -----------------------------------------------------------------------------------

    @staticmethod
    def advance_grammars(rows: list[ContextRow], tokens: list[int | None]) -> None:
        """Each constrained sample takes the token it drew."""
        for row, context, sample_index in rows:
            state = context.runner_state
            if state is not None and state.matchers is not None and tokens[row] is not None:
                state.matchers[sample_index].take(tokens[row])


def _indices(rows: list[int], columns: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(columns, dtype=torch.int64, device=device))


def token_logprobs(log_probs: torch.Tensor, chosen: torch.Tensor, top_counts: list[int]) -> list[TokenLogprob]:
    """One TokenLogprob per row of ``log_probs`` (fp32 log-softmax [rows, vocab]): the chosen token's, its rank,
    and the row's ``top_counts[i]`` best. One transfer to the host for the lot."""
    picked = log_probs.gather(1, chosen[:, None])
    ranks = (log_probs > picked).sum(dim=-1) + 1
    most = max(top_counts)
    top = log_probs.topk(most, dim=-1) if most else None
    host = [picked.squeeze(1).tolist(), ranks.tolist(), chosen.tolist()]
    top_values, top_ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
    found = []
    for i, count in enumerate(top_counts):
        best = tuple(zip(top_ids[i][:count], top_values[i][:count])) if count else ()
        found.append(TokenLogprob(host[2][i], host[0][i], host[1][i], best))
    return found


def prompt_logprobs(logits: torch.Tensor, token_ids: tuple[int, ...], start_pos: int, context: SamplingContext,
                    top: int) -> tuple[int, tuple[TokenLogprob, ...]]:
    """The log-probabilities of the prompt tokens a prefill chunk predicts: ``logits`` [len(token_ids), vocab]
    are the chunk's, each position's predicting the next token. The chunk's last position predicts the next
    chunk's first token, so its log-softmax waits in the request's state for that chunk. Returns the prompt
    position of the first entry and the entries."""
    state = _state(context)
    num_prompt = context.num_prompt_tokens
    entries: list[TokenLogprob] = []
    first_position = start_pos
    pending = state.pending_prompt_row
    state.pending_prompt_row = None
    if pending is not None and pending[0] == start_pos - 1 and start_pos < num_prompt:
        target = torch.tensor([token_ids[0]], dtype=torch.int64, device=logits.device)
        entries.extend(token_logprobs(pending[1][None, :], target, [top]))
    else:
        first_position = start_pos + 1
    # Positions start .. end-2 predict tokens start+1 .. end-1; only prompt tokens count.
    last = min(len(token_ids) - 1, num_prompt - 1 - start_pos)
    for begin in range(0, max(last, 0), _PROMPT_LOGPROB_SLICE):
        end = min(begin + _PROMPT_LOGPROB_SLICE, last)
        log_probs = torch.log_softmax(logits[begin:end].float(), dim=-1)
        targets = torch.tensor(token_ids[begin + 1:end + 1], dtype=torch.int64, device=logits.device)
        entries.extend(token_logprobs(log_probs, targets, [top] * (end - begin)))
    end_pos = start_pos + len(token_ids)
    if end_pos < num_prompt:
        state.pending_prompt_row = (end_pos - 1, torch.log_softmax(logits[-1].float(), dim=-1))
    return first_position, tuple(entries)
