"""The forward-only floor: how fast any engine could go on the batches a run actually formed.

For every step of the run it prices the model forward alone, with no KV context:
the step's tokens go through the decoder as independent one-token sequences (so
attention costs nothing), then the LM head runs over the rows that were sampled.
What a real engine adds on top (attention over its context, scheduling,
sampling, bookkeeping) is what the floor leaves out.

Pricing each of thousands of steps would double the bench, so the floor times a
grid of at most ``GRID_POINTS`` token counts (every distinct one when there are
few) and interpolates between them; forward time is close to linear in tokens.
"""

from __future__ import annotations

from time import perf_counter

import numpy as np
import torch

GRID_POINTS = 24
REPEATS = 2


def grid(values: list[int], max_points: int = GRID_POINTS) -> list[int]:
    """Distinct values when few, else quantiles of them; always the smallest and the largest."""
    distinct = sorted(set(values))
    if len(distinct) <= max_points:
        return distinct
    picks = np.quantile(np.asarray(values, dtype=np.float64), np.linspace(0.0, 1.0, max_points))
    return sorted({int(round(p)) for p in picks} | {distinct[0], distinct[-1]})


def interpolate(points: dict[int, float], values: list[int]) -> np.ndarray:
    xs = sorted(points)
    return np.interp(np.asarray(values, dtype=np.float64), xs, [points[x] for x in xs])


def _best_time(fn, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(REPEATS):
        sync()
        start = perf_counter()
        fn()
        sync()
        best = min(best, perf_counter() - start)
    return best


class ForwardFloor:
    """Times the decoder and the LM head of ``model``; prices a run's step shapes from those times."""

    def __init__(self, model) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.device = model.device
        self._body: dict[int, float] = {}
        self._head: dict[int, float] = {}

    def seconds(self, step_shapes: list[tuple[int, int]]) -> float:
        """Forward-only time of every (tokens forwarded, rows sampled) step, summed."""
        if not step_shapes:
            return 0.0
        tokens = [t for t, _ in step_shapes]
        rows = [r for _, r in step_shapes]
        self.model.set_attn_implementation("sdpa")  # a kvscope engine may have switched it
        with torch.inference_mode():
            self._measure(self._body, grid(tokens), self._time_decoder)
            self._measure(self._head, grid([r for r in rows if r] or [1]), self._time_head)
        head = np.where(np.asarray(rows) > 0, interpolate(self._head, rows), 0.0)
        return float(interpolate(self._body, tokens).sum() + head.sum())

    @staticmethod
    def _measure(table: dict[int, float], sizes: list[int], timer) -> None:
        missing = [s for s in sizes if s not in table]
        if missing:
            timer(max(missing))  # warm-up at the largest size: allocator and thread pool settle
        for size in missing:
            table[size] = timer(size)

    def _time_decoder(self, num_tokens: int) -> float:
        ids = torch.randint(0, self.lm_head.out_features, (num_tokens, 1), device=self.device)
        positions = torch.zeros((num_tokens, 1), dtype=torch.long, device=self.device)
        return _best_time(lambda: self.decoder(input_ids=ids, position_ids=positions, use_cache=False),
                          self.device)

    def _time_head(self, num_rows: int) -> float:
        hidden = torch.randn(num_rows, self.lm_head.in_features, dtype=self.model.dtype, device=self.device)
        return _best_time(lambda: self.lm_head(hidden), self.device)
