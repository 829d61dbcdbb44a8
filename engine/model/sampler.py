"""Turn the last-position logits of each sampled row into a token id, on the logits' own device.

The logits never cross to the host: only the sampled ids do (one small copy per step). Every stage is a
tensor op over the batch, and the vocabulary is read in chunks so the costly passes are few:

- greedy rows take the first maximum, found as the first chunk holding the row's maximum and then the
  maximum within it (torch's max propagates NaN, so a NaN row shows itself there without a pass of its own);
  that one pass over their logits is all they cost, and random rows never pay it (they find their own maxima);
- the other rows become unnormalised probabilities exp((logit - max) / temperature); min-p and top-k zero
  what they exclude (top-k finds its k-th largest with a partial top-k, never a sort of the vocabulary);
- a token is drawn by inverse CDF: one uniform per row picks a chunk from the chunk sums, then a token within
  that chunk, so there is no per-token noise and no cumulative sum over the whole vocabulary;
- top-p by rejection: the drawn token belongs to the nucleus when the mass strictly above it is under top_p;
  otherwise every token at or below it is cut (none of them is in the nucleus either) and the row draws
  again. Accepted draws follow the nucleus distribution exactly. A row still rejected after a few rounds is
  finished with a sort of its own row only. The mass top_p is a share of is the draw's own total (the sum of
  its chunk sums), so the test costs one cut and one sum. No top-k of the vocabulary comes first: it helps
  only rows whose nucleus is a few tokens, and a partial top-k of 64 costs more on a CPU (about 30 ms at
  batch 256) than this whole path.

On a CPU with kvscope's C++ kernels, random rows without top-k take kernels/sampler_cpu.cpp instead: the
same algorithm and uniforms, a row at a time, so a row's probabilities stay in cache between the stages instead
of crossing memory once per stage (about 10 ms instead of 25-50 at batch 256 over SmolLM2's vocabulary, one
thread). Other devices, and rows with top-k, take the tensor ops. Greedy rows there take the kernel's first
maximum: one read of each row, where the chunked tensor version reads the picked chunks a second time.

Rows of requests with penalties, a logit bias, bans, a grammar or log-probabilities pass through
engine/model/logits_processing.py first; the other rows never do.

Each row's uniforms come from a counter-based hash of (seed, sample index, position, round), so a seeded row
draws the same tokens whatever shares its batch, and after a preemption recomputes it. Rows without a seed
take their key from the sampler's generator.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from kvscope.engine.config import SamplingParams
from kvscope.engine.model.logits_processing import ContextRow, LogitsProcessor, token_logprobs
from kvscope.engine.outputs import TokenLogprob
from kvscope.kernels import cpu as cpu_kernels

CHUNK = 1024            # tokens per chunk of the vocabulary
REJECTION_ROUNDS = 4    # top-p draws before a row falls back to sorting its own row
_U_MAX = 1.0 - 2.0 ** -20   # keeps a draw's target strictly under its row's mass in fp32
_JUST_UNDER_ONE = 1.0 - 2.0 ** -24  # F.threshold keeps x > this: x >= 1.0 in float32


class SampleRow(NamedTuple):    # one per sampled row per step: cheap to build
    params: SamplingParams
    sample_index: int
    position: int


def _mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective scramble of uint64 counters."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def row_uniforms(keys: np.ndarray, positions: np.ndarray, sample_indices: np.ndarray, rounds: int) -> np.ndarray:
    """[rows, rounds] uniforms in [0, 1), each a pure function of its row's key, position, index and round."""
    with np.errstate(over="ignore"):
        row = _mix64(_mix64(_mix64(keys.astype(np.uint64)) ^ positions.astype(np.uint64))
                     ^ sample_indices.astype(np.uint64))
        counters = row[:, None] + np.arange(1, rounds + 1, dtype=np.uint64)[None, :]
    bits = _mix64(counters) >> np.uint64(40)                 # 24 bits: exact in float32
    return np.minimum(bits.astype(np.float64) / 2.0 ** 24, _U_MAX)


def _chunk_view(x: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, chunks, CHUNK] over a [rows, width] tensor whose width is a multiple of CHUNK."""
    return x[:, :width].view(x.shape[0], width // CHUNK, CHUNK)


def first_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the index of the first maximum (of the first NaN, if any) and the row's maximum."""
    rows, vocab = logits.shape
    whole = vocab - vocab % CHUNK
    maxima = [_chunk_view(logits, whole).amax(dim=-1)] if whole else []
    if whole < vocab:
        maxima.append(logits[:, whole:].amax(dim=-1, keepdim=True))
    chunk_max = torch.cat(maxima, dim=1) if len(maxima) > 1 else maxima[0]
    chunk = chunk_max.argmax(dim=-1)
    starts = chunk * CHUNK
    if whole == vocab:      # every chunk is whole: pick each row's chunk out of the chunk view, no index tensor
        window = _chunk_view(logits, whole)[torch.arange(rows, device=logits.device), chunk]
    else:
        columns = starts[:, None] + torch.arange(CHUNK, device=logits.device)[None, :]
        inside = columns < vocab
        window = logits.gather(1, columns.clamp(max=vocab - 1)).masked_fill(~inside, float("-inf"))
    within = window.argmax(dim=-1)
    return starts + within, chunk_max.gather(1, chunk[:, None]).squeeze(1)


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first maximum, and which rows hold NaN (the CPU kernel answers -1 for those)."""
    if logits.device.type == "cpu" and cpu_kernels.available():
        tokens = cpu_kernels.first_argmax(logits)
        return tokens, tokens < 0
    tokens, row_max = first_argmax(logits)
    return tokens, torch.isnan(row_max)


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._scratch: torch.Tensor | None = None   # reused: a fresh [batch, vocab] buffer costs page faults
        self.processor: LogitsProcessor | None = None   # made when a row first needs it

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[int | None]:
        """logits: [len(rows), vocab] on any device. Returns a token per row, or None where the logits hold NaN."""
        return self.sample_rows(logits, rows, ())[0]

    def sample_rows(self, logits: torch.Tensor, rows: list[SampleRow], contexts: list[ContextRow]
                    ) -> tuple[list[int | None], dict[int, TokenLogprob]]:
        """As ``sample``, with the rows in ``contexts`` processed first (their logits change in place); also the
        log-probabilities of the rows that ask, by row."""
        logits = logits.float().contiguous()
        if not contexts:
            return self._sample(logits, rows), {}
        if self.processor is None:
            self.processor = LogitsProcessor(logits.shape[1])
        asking = [c for c in contexts if c.context.params.logprobs is not None]
        if asking:
            index = torch.tensor([c.row for c in asking], dtype=torch.int64, device=logits.device)
            raw = torch.log_softmax(logits[index], dim=-1)
        self.processor.apply(logits, contexts)
        tokens = self._sample(logits, rows)
        self.processor.advance_grammars(contexts, tokens)
        if not asking:
            return tokens, {}
        chosen = torch.tensor([max(tokens[c.row] or 0, 0) for c in asking], dtype=torch.int64, device=logits.device)
        found = token_logprobs(raw, chosen, [c.context.params.logprobs for c in asking])
        return tokens, {c.row: logprob for c, logprob in zip(asking, found)}

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[int | None]:
        greedy = [row.params.greedy for row in rows]
        if all(greedy):
            tokens, bad = _greedy(logits)
        elif not any(greedy):
            tokens, bad = self._sample_random(logits, rows)
        else:
            tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
            bad = torch.empty(len(rows), dtype=torch.bool, device=logits.device)
            for wanted in (True, False):
                chosen = [i for i, is_greedy in enumerate(greedy) if is_greedy is wanted]
                index = torch.tensor(chosen, dtype=torch.int64, device=logits.device)
                part = logits[index]
                found = _greedy(part) if wanted else self._sample_random(part, [rows[i] for i in chosen])
                tokens[index], bad[index] = found
        tokens = tokens.masked_fill(bad, -1)
        return [None if token < 0 else token for token in tokens.tolist()]

    def _probabilities(self, logits: torch.Tensor, row_max: torch.Tensor, temperatures: np.ndarray) -> torch.Tensor:
        """[rows, chunks * CHUNK]: exp((logit - max) / T) in a reused buffer, zero past the vocabulary."""
        rows, vocab = logits.shape
        width = -(-vocab // CHUNK) * CHUNK
        if (self._scratch is None or self._scratch.device != logits.device
                or self._scratch.numel() < rows * width):
            self._scratch = torch.empty(rows * width, dtype=torch.float32, device=logits.device)
        probs = self._scratch[:rows * width].view(rows, width)
        shift = torch.nan_to_num(row_max, nan=0.0)[:, None]
        if (temperatures == temperatures[0]).all():
            scale = float(1.0 / temperatures[0])
            torch.add(shift * -scale, logits, alpha=scale, out=probs[:, :vocab])
        else:
            torch.sub(logits, shift, out=probs[:, :vocab])
            probs[:, :vocab].mul_(torch.from_numpy(1.0 / temperatures).float().to(logits.device)[:, None])
        probs.exp_()
        if width > vocab:
            probs[:, vocab:].zero_()
        return probs

    def _sample_random(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens for the non-greedy ``rows`` (one per row of ``logits``), and which rows hold NaN. On a CPU with
        the C++ kernels, rows without top-k take the fused kernel (sampler_cpu.cpp: the same algorithm, a row
        at a time in cache); the others, and every row on another device, take the tensor ops below."""
        count = len(rows)
        params = [row.params for row in rows]
        knobs = _Knobs(
            np.fromiter((p.temperature for p in params), dtype=np.float64, count=count),
            np.fromiter((p.top_k for p in params), dtype=np.int64, count=count),
            np.fromiter((p.top_p for p in params), dtype=np.float64, count=count),
            np.fromiter((p.min_p for p in params), dtype=np.float64, count=count),
            row_uniforms(self._keys(params), np.fromiter((r.position for r in rows), dtype=np.int64, count=count),
                         np.fromiter((r.sample_index for r in rows), dtype=np.int64, count=count),
                         REJECTION_ROUNDS + 1))
        if logits.device.type != "cpu" or not cpu_kernels.available():
            return self._sample_tensors(logits, knobs)
        limited = (knobs.top_ks > 0) & (knobs.top_ks < logits.shape[1])
        if not limited.any():
            return _sample_fused(logits, knobs)
        tokens = torch.empty(count, dtype=torch.int64)
        bad = torch.empty(count, dtype=torch.bool)
        for chosen in (np.flatnonzero(~limited), np.flatnonzero(limited)):
            if chosen.size:
                index = torch.from_numpy(chosen)
                part, part_knobs = logits[index], knobs.take(chosen)
                sample = self._sample_tensors if limited[chosen[0]] else _sample_fused
                tokens[index], bad[index] = sample(part, part_knobs)
        return tokens, bad

    def _sample_tensors(self, logits: torch.Tensor, knobs: _Knobs) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensor-op path over the whole batch (any device)."""
        device, count = logits.device, logits.shape[0]
        temperatures, top_ks, top_ps, min_ps = knobs.temperatures, knobs.top_ks, knobs.top_ps, knobs.min_ps
        uniforms = torch.from_numpy(knobs.uniforms).float().to(device)
        vocab = logits.shape[1]
        row_max = logits.amax(dim=-1)     # the random rows' one pass of their own over the logits
        probs = self._probabilities(logits, row_max, temperatures)
        scale = torch.ones(count, dtype=torch.float32, device=device)  # what the row's maximum now reads
        limited = np.flatnonzero((top_ks > 0) & (top_ks < vocab))
        if limited.size:
            chosen = torch.from_numpy(limited).to(device)
            best = _rows(probs, chosen).topk(int(top_ks[limited].max()), dim=-1).values
            kth = best.gather(1, torch.from_numpy(top_ks[limited] - 1).to(device)[:, None]).squeeze(1)
            # A k-th best that underflowed to 0 would keep everything; 1e-30 of the maximum cuts nothing real.
            _keep_at_least(probs, chosen, kth.clamp(min=1e-30), scale)
        if (min_ps > 0).any():
            chosen = torch.from_numpy(np.flatnonzero(min_ps > 0)).to(device)
            threshold = torch.from_numpy(min_ps[min_ps > 0]).float().to(device) * scale[chosen]
            _keep_at_least(probs, chosen, threshold, scale)
        tokens, mass = _draw(probs, uniforms[:, 0])
        nucleus = np.flatnonzero(top_ps < 1.0)
        if nucleus.size:
            tokens = _top_p(probs, mass, tokens, torch.from_numpy(nucleus).to(device),
                            torch.from_numpy(top_ps[nucleus]).float().to(device), uniforms)
        return tokens, torch.isnan(row_max)

    def _keys(self, params: list[SamplingParams]) -> np.ndarray:
        """A 64-bit key per row: its seed, or a draw from the sampler's generator."""
        unseeded = sum(p.seed is None for p in params)
        drawn = iter(torch.randint(0, 2 ** 62, (unseeded,), generator=self.generator).tolist())
        return np.array([p.seed if p.seed is not None else next(drawn) for p in params], dtype=np.uint64)


class _Knobs(NamedTuple):
    """The random rows' settings as arrays, and their uniforms [rows, REJECTION_ROUNDS + 1]."""
    temperatures: np.ndarray
    top_ks: np.ndarray
    top_ps: np.ndarray
    min_ps: np.ndarray
    uniforms: np.ndarray

    def take(self, index: np.ndarray) -> _Knobs:
        return _Knobs(*(values[index] for values in self))


def _sample_fused(logits: torch.Tensor, knobs: _Knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, min-p and top-p in the CPU kernel; it answers -1 for a row it cannot draw from."""
    def floats(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).float()

    tokens = cpu_kernels.sample_nucleus(logits, floats(1.0 / knobs.temperatures), floats(knobs.top_ps),
                                        floats(knobs.min_ps), floats(knobs.uniforms))
    return tokens, tokens < 0


def _rows(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    return probs if chosen.numel() == probs.shape[0] else probs[chosen]


def _keep_at_least(probs: torch.Tensor, chosen: torch.Tensor, thresholds: torch.Tensor, scale: torch.Tensor) -> None:
    """Zero what lies under each chosen row's threshold. Rows are divided by their threshold so that one
    scalar cut (at 1.0) serves the whole batch; ``scale`` follows each row's maximum through that."""
    part = _rows(probs, chosen)
    part.div_(thresholds[:, None])
    F.threshold_(part, _JUST_UNDER_ONE, 0.0)
    if part is not probs:
        probs[chosen] = part
    scale[chosen] = scale[chosen] / thresholds


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw per row: a chunk from the chunk sums, then a token inside that chunk. Also each row's
    mass (the sum of its chunk sums)."""
    rows, width = probs.shape
    chunk_mass = _chunk_view(probs, width).sum(dim=-1)
    cumulative = chunk_mass.cumsum(dim=-1)
    target = uniforms * cumulative[:, -1]
    chunk = (cumulative <= target[:, None]).sum(dim=-1).clamp(max=cumulative.shape[1] - 1)
    before = torch.where(chunk > 0, cumulative.gather(1, (chunk - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    columns = chunk[:, None] * CHUNK + torch.arange(CHUNK, device=probs.device)[None, :]
    inside = probs.gather(1, columns).cumsum(dim=-1)
    # Rounding may put the chunk's own cumulative sum a hair off its chunk sum: keep the target inside it.
    local = torch.minimum((target - before).clamp(min=0.0), inside[:, -1] * _U_MAX)
    offset = (inside <= local[:, None]).sum(dim=-1).clamp(max=CHUNK - 1)
    return chunk * CHUNK + offset, cumulative[:, -1]


def _top_p(probs: torch.Tensor, mass: torch.Tensor, tokens: torch.Tensor, pending: torch.Tensor,
           top_ps: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Redraw the ``pending`` rows whose token lies outside their top-p nucleus (see the module's doc); ``mass``
    is each row's whole mass."""
    tokens = tokens.clone()
    part = _rows(probs, pending)
    base = mass[pending]    # the mass top_p is a share of, in the row's current units
    drawn = tokens[pending]
    for round_ in range(1, REJECTION_ROUNDS + 1):
        pivot = part.gather(1, drawn[:, None])
        part.div_(pivot)
        F.threshold_(part, 1.0, 0.0)                # what lies strictly above the drawn token
        base = base / pivot.squeeze(1)
        rejected = part.sum(dim=-1) >= top_ps * base
        accepted = ~rejected
        tokens[pending[accepted]] = drawn[accepted]
        if not bool(rejected.any()):
            return tokens
        pending, part, base, top_ps = pending[rejected], part[rejected], base[rejected], top_ps[rejected]
        if round_ < REJECTION_ROUNDS:
            drawn = _draw(part, uniforms[pending, round_])[0]
    tokens[pending] = _sorted_nucleus_draw(part, base, top_ps, uniforms[pending, REJECTION_ROUNDS])
    return tokens


def _sorted_nucleus_draw(part: torch.Tensor, base: torch.Tensor, top_ps: torch.Tensor,
                         uniforms: torch.Tensor) -> torch.Tensor:
    """The exact nucleus of the few rows rejection did not settle, by sorting those rows only."""
    values, order = part.sort(dim=-1, descending=True)
    cumulative = values.double().cumsum(dim=-1)
    kept = values.masked_fill(cumulative - values.double() >= (top_ps * base)[:, None], 0.0)
    kept_cumulative = kept.double().cumsum(dim=-1)
    target = uniforms.double() * kept_cumulative[:, -1]
    offset = (kept_cumulative <= target[:, None]).sum(dim=-1).clamp(max=part.shape[1] - 1)
    return order.gather(1, offset[:, None]).squeeze(1)
