"""Micro-benchmark of one layer's paged decode attention (gather + attention), for sizing and regressions.

    python -m kernels.bench                      # SmolLM2-135M shapes, batch 64, context ~300, fp32 and bf16
"""

from __future__ import annotations

import statistics
import time
from types import ModuleType

import torch

from kernels import reference
from kernels.testing import random_layout


def bench_decode(
    num_seqs: int = 64,
    context_len: int = 300,
    jitter: int = 40,
    block_size: int = 16,
    num_q_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    backend: ModuleType | None = None,
    iters: int = 30,
    warmup: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """Median time of one ``paged_decode_attention`` call; context lengths within ``context_len ± jitter``.

    ``backend`` is ``kernels.reference`` or ``kernels.triton_ops``; default: what ``kernels`` dispatches to.
    """
    if backend is None:
        import kernels as backend
    gen = torch.Generator().manual_seed(seed)
    low, high = max(1, context_len - jitter), context_len + jitter
    context_lens = torch.randint(low, high + 1, (num_seqs,), generator=gen).tolist()
    layout = random_layout(context_lens, block_size, num_kv_heads, head_dim, dtype, gen, poison_unused=False)
    kv_layer = layout.kv_layer.to(device)
    block_tables, lens = layout.block_tables.to(device), layout.context_lens.to(device)
    query = torch.randn(num_seqs, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim ** -0.5
    synchronize = torch.cuda.synchronize if kv_layer.is_cuda else (lambda: None)
    times = []
    for step in range(warmup + iters):
        synchronize()
        start = time.perf_counter()
        backend.paged_decode_attention(query, kv_layer, block_tables, lens, scale)
        synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    median_s = statistics.median(times)
    gathered_bytes = 2 * sum(context_lens) * num_kv_heads * head_dim * kv_layer.element_size()
    return {
        "median_ms": median_s * 1e3,
        "min_ms": min(times) * 1e3,
        "context_tokens": float(sum(context_lens)),
        "kv_gb_per_s": gathered_bytes / median_s / 1e9,
    }


def main() -> None:
    print(f"torch threads: {torch.get_num_threads()}")
    for dtype in (torch.float32, torch.bfloat16):
        result = bench_decode(dtype=dtype, backend=reference)
        print(f"reference decode, B=64 ctx~300 bs=16 Hq=9 Hkv=3 D=64 {dtype}: "
              f"{result['median_ms']:.2f} ms/layer (min {result['min_ms']:.2f}), "
              f"{result['kv_gb_per_s']:.1f} GB/s of context K/V")


if __name__ == "__main__":
    main()
