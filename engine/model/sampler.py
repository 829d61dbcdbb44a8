"""Turn the last-position logits of each sampled row into a token id.

Greedy rows take the argmax. The others go through temperature, top-k and
top-p, then the exponential-race trick: argmax(p / q) with q ~ Exp(1) draws
from p. A seeded row draws its noise from a generator keyed by (seed, sample
index, position), so its tokens do not depend on what else shares the batch,
nor on whether the request was preempted and recomputed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvscope.engine.config import SamplingParams


class SampleRow(NamedTuple):    # one per sampled row per step: cheap to build
    params: SamplingParams
    sample_index: int
    position: int


def _row_generator(seed: int, sample_index: int, position: int) -> torch.Generator:
    mixed = (seed * 1_000_003 + sample_index * 8191 + position) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator().manual_seed(mixed)


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[int | None]:
        """logits: [len(rows), vocab]. Returns a token per row, or None where the logits hold NaN."""
        logits = logits.float().cpu()
        bad = torch.isnan(logits).any(dim=-1).tolist()
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy and not bad[i]]
        if random_rows:
            tokens[random_rows] = self._sample_random(logits[random_rows], [rows[i] for i in random_rows])
        return [None if bad[i] else int(token) for i, token in enumerate(tokens.tolist())]

    def _sample_random(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temperatures = torch.tensor([row.params.temperature for row in rows]).unsqueeze(1)
        sorted_logits, order = (logits / temperatures).sort(dim=-1, descending=True)
        self._apply_top_k(sorted_logits, rows)
        self._apply_top_p(sorted_logits, rows)
        probs = sorted_logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            generator = (self.generator if row.params.seed is None
                         else _row_generator(row.params.seed, row.sample_index, row.position))
            noise[i].exponential_(generator=generator)
        picked = (probs / noise).argmax(dim=-1, keepdim=True)
        return order.gather(1, picked).squeeze(1)

    @staticmethod
    def _apply_top_k(sorted_logits: torch.Tensor, rows: list[SampleRow]) -> None:
        vocab = sorted_logits.shape[1]
        ks = torch.tensor([row.params.top_k if row.params.top_k > 0 else vocab for row in rows])
        if (ks < vocab).any():
            ranks = torch.arange(vocab).unsqueeze(0)
            sorted_logits.masked_fill_(ranks >= ks.unsqueeze(1), float("-inf"))

    @staticmethod
    def _apply_top_p(sorted_logits: torch.Tensor, rows: list[SampleRow]) -> None:
        top_ps = torch.tensor([row.params.top_p for row in rows]).unsqueeze(1)
        if (top_ps < 1.0).any():
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # Keep a token while the mass before it is under top_p; the first token always stays.
            sorted_logits.masked_fill_(mass_before >= top_ps, float("-inf"))
