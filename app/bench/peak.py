"""What this machine's arithmetic can reach, and how much of it a system used: matmul peak and model FLOP utilisation.

The peak is measured, not read from a datasheet: the best of a few large matmuls per dtype on the threads the
bench runs with, through the same packed linear the engine uses (``kernels.cpu.linear``, or torch's where the
C++ kernels are not built). A system's model FLOP utilisation (MFU) is the model FLOPs its tokens needed,
divided by its wall time, over that peak: 2 FLOPs per weight per token through the decoder's linear layers for
every prompt and output token, and through the LM head for every output token (attention's own FLOPs are left
out, as is usual). A system at 40% MFU leaves 60% of the machine's multiply-adds unused; the rest of its time
went to memory, dispatch and everything that is not a matmul.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

# One large product, about a prefill chunk of the default model's MLP: [2048, 576] x [576, 3072].
_SHAPE = (2048, 576, 3072)


@dataclass(frozen=True)
class ModelFlops:
    per_token: int          # through the decoder's linear layers, per token of prompt or output
    head_per_token: int     # through the LM head, per output token

    def of_run(self, prompt_tokens: int, output_tokens: int) -> int:
        return self.per_token * (prompt_tokens + output_tokens) + self.head_per_token * output_tokens


def model_flops(model: nn.Module) -> ModelFlops:
    """2 x the weights of every linear layer (the LM head apart), from the modules' shapes (packed or not)."""
    head = model.get_output_embeddings()
    body = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    head_weights = head.in_features * head.out_features if isinstance(head, nn.Linear) else 0
    return ModelFlops(2 * body, 2 * head_weights)


def matmul_peak_gflops(dtype: torch.dtype, repeats: int = 3, device: str = "cpu") -> float:
    """Best GFLOP/s of one [2048, 576] x [576, 3072] product in ``dtype`` on the current torch threads."""
    m, k, n = _SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
    weight = torch.randn(n, k, generator=generator).to(device=device, dtype=dtype)
    product = _product(x, weight)
    product()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product()
        if device != "cpu":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def _product(x: torch.Tensor, weight: torch.Tensor):
    from kvscope.kernels import cpu

    if x.device.type == "cpu" and cpu.linear_available():
        packed = cpu.pack_linear_weight(weight)
        return lambda: cpu.linear(x, packed, weight.shape[0])
    return lambda: torch.nn.functional.linear(x, weight)


def utilisation(flops: ModelFlops, prompt_tokens: int, output_tokens: int, wall_s: float | None,
                peak_gflops: float | None) -> float | None:
    if not wall_s or not peak_gflops:
        return None
    return flops.of_run(prompt_tokens, output_tokens) / wall_s / (peak_gflops * 1e9)
