"""`kvscope bench kernels`: what one layer's paged attention costs per call, and how near the memory limit it runs.

Times ``paged_decode_attention`` at batch 1, 16 and 64 over short and long contexts, and
``paged_prefill_attention`` over one 2048-token step of mixed chunks (fresh prompts, prefix-cache hits, a
chunked-prefill continuation), in float32 and bfloat16, with SmolLM2-135M's attention shape. On CPU each case
runs through both paths, interleaved call by call: the C++ kernels (when they built) and the torch reference;
on CUDA, the Triton kernels.

Each call reads its own copy of the pool, as a model's layers each read their own cache, so K/V come from
memory and not from a cache the previous call warmed. A step's plan is reused across layers by the reference
kernels, and so it is here: the first (untimed) call builds it. Reported: median and best wall time per call,
the K/V bytes a call must read (every context token's key and value, once), the rate that makes at the median,
and that rate against the machine's copy bandwidth (measured first, a large ``copy_`` on the same threads):
decode attention is bound by memory, so that fraction is how near the physical limit it runs.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvscope.kernels import cpu, reference
from kvscope.kernels import dispatch as kernels
from kvscope.kernels.testing import random_layout


@dataclass(frozen=True)
class AttentionShape:
    """The model side of the kernels' shapes (default: SmolLM2-135M)."""

    num_q_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    min_context: int  # context lengths are drawn uniformly from [min_context, max_context]
    max_context: int


@dataclass(frozen=True)
class PrefillCase:
    chunks: tuple[tuple[int, int], ...]  # per sequence: (tokens already cached, tokens in this chunk)


DECODE_CASES = (
    DecodeCase(1, 300, 300), DecodeCase(1, 2048, 2048),
    DecodeCase(16, 56, 552), DecodeCase(16, 1536, 2560),
    DecodeCase(64, 56, 552), DecodeCase(64, 1536, 2560),
)
PREFILL_CASES = (
    PrefillCase(((0, 700), (0, 300), (256, 200), (1024, 512), (0, 64), (0, 64), (0, 64), (0, 64), (48, 80))),
)
_COLD_BYTES = 128 * 2**20  # pool copies per case: together at least this much (4x this machine's L3)
_MAX_COPIES = 8
_COPY_BYTES = 256 * 2**20  # the bandwidth probe's buffer: far past any cache


def kernel_paths(device: str) -> dict:
    """The implementations to time, by name: each module has paged_decode_attention and paged_prefill_attention."""
    if device.startswith("cuda"):
        return {"triton" if kernels.triton_available() else "torch": kernels}
    return {"C++": cpu, "torch": reference} if cpu.available() else {"torch": reference}


def copy_bandwidth(device: str = "cpu", repeats: int = 5) -> float:
    """The machine's copy bandwidth in GB/s: bytes read plus bytes written by one large copy_, best of repeats."""
    source = torch.ones(_COPY_BYTES // 4, device=device)
    target = torch.empty_like(source)
    best = min(_time(lambda pool: target.copy_(pool), [source], repeats, 1, device))
    return 2 * _COPY_BYTES / best / 1e9


def run_kernel_bench(
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    decode_cases: tuple[DecodeCase, ...] = DECODE_CASES,
    prefill_cases: tuple[PrefillCase, ...] = PREFILL_CASES,
    shape: AttentionShape = AttentionShape(),
    repeats: int = 20,
    warmup: int = 3,
    device: str = "cpu",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    copy_gb_per_s: float | None = None,
) -> list[dict]:
    """One row per (case, dtype, path): decode cases first, then prefill. With ``copy_gb_per_s``, each row
    also gives its K/V rate as a fraction of it."""
    paths = kernel_paths(device)
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        cases = [(_bench_decode, case) for case in decode_cases] + [(_bench_prefill, case) for case in prefill_cases]
        for bench, case in cases:
            for row in bench(case, shape, dtype, repeats, warmup, device, seed, paths):
                row["of_copy"] = row["gb_per_s"] / copy_gb_per_s if copy_gb_per_s else None
                rows.append(row)
                if progress:
                    progress(table_row(row))
    return rows


def _bench_decode(case, shape, dtype, repeats, warmup, device, seed, paths) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(case.min_context, case.max_context + 1, (case.batch,), generator=gen).tolist()
    pools, tables, context_lens = _pools(lens, shape, dtype, device, gen)
    query = _query(case.batch, shape, dtype, device, gen)
    scale = shape.head_dim ** -0.5
    calls = {name: (lambda pool, path=path: path.paged_decode_attention(query, pool, tables, context_lens, scale))
             for name, path in paths.items()}
    context = (f"{case.min_context}" if case.min_context == case.max_context
               else f"{case.min_context}-{case.max_context}")
    return [_row("decode", name, dtype, case.batch, context, lens, case.batch, shape, times)
            for name, times in _time_interleaved(calls, pools, repeats, warmup, device).items()]


def _bench_prefill(case, shape, dtype, repeats, warmup, device, seed, paths) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    lens = [prefix + length for prefix, length in case.chunks]
    pools, tables, context_lens = _pools(lens, shape, dtype, device, gen)
    query_lens = [length for _, length in case.chunks]
    query = _query(sum(query_lens), shape, dtype, device, gen)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device)
    scale = shape.head_dim ** -0.5
    calls = {name: (lambda pool, path=path: path.paged_prefill_attention(query, pool, tables, cu_seqlens,
                                                                         context_lens, scale, max(query_lens)))
             for name, path in paths.items()}
    cached = sum(prefix for prefix, _ in case.chunks)
    return [_row("prefill", name, dtype, len(case.chunks), f"{cached} cached + {sum(query_lens)} new", lens,
                 sum(query_lens), shape, times)
            for name, times in _time_interleaved(calls, pools, repeats, warmup, device).items()]


def _pools(lens, shape, dtype, device, gen):
    """Enough copies of one random layer's pool that cycling through them never hits a warm cache."""
    layout = random_layout(lens, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype, gen,
                           poison_unused=False)
    first = layout.kv_layer.to(device)
    layer_bytes = first.numel() * first.element_size()
    copies = min(_MAX_COPIES, max(2, math.ceil(_COLD_BYTES / layer_bytes)))
    pools = [first] + [first.clone() for _ in range(copies - 1)]
    return pools, layout.block_tables.to(device), layout.context_lens.to(device)


def _query(num_tokens, shape, dtype, device, gen):
    # Head-major then transposed, as the model runner hands queries over.
    query = torch.randn(shape.num_q_heads, num_tokens, shape.head_dim, generator=gen).to(dtype).to(device)
    return query.transpose(0, 1)


def _time(call, pools, repeats, warmup, device) -> list[float]:
    return _time_interleaved({"": call}, pools, repeats, warmup, device)[""]


def _time_interleaved(calls: dict, pools, repeats, warmup, device) -> dict[str, list[float]]:
    """Wall time of each call per repeat, the calls taking turns so that a noisy moment hits them all."""
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times = {name: [] for name in calls}
    for i in range(warmup + repeats):
        pool = pools[i % len(pools)]
        for name, call in calls.items():
            synchronize()
            start = time.perf_counter()
            call(pool)
            synchronize()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def _row(kernel, path, dtype, seqs, context, lens, query_tokens, shape, times) -> dict:
    element = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * sum(lens) * shape.num_kv_heads * shape.head_dim * element
    median = statistics.median(times)
    return {
        "bench": "kernels", "kernel": kernel, "path": path, "dtype": str(dtype).removeprefix("torch."), "seqs": seqs,
        "context": context, "context_tokens": sum(lens), "query_tokens": query_tokens,
        "kv_mib": kv_bytes / 2**20, "median_ms": median * 1e3, "min_ms": min(times) * 1e3,
        "gb_per_s": kv_bytes / median / 1e9,
    }


_COLUMNS = (("kernel", 8, "s"), ("path", 6, "s"), ("dtype", 9, "s"), ("seqs", 5, "d"), ("context", 22, "s"),
            ("context_tokens", 8, "d"), ("query_tokens", 6, "d"), ("kv_mib", 8, ".1f"),
            ("median_ms", 10, ".3f"), ("min_ms", 8, ".3f"), ("gb_per_s", 7, ".1f"), ("of_copy", 7, ".0%"))
_HEADERS = {"context_tokens": "ctx tok", "query_tokens": "q tok", "kv_mib": "KV MiB", "median_ms": "median ms",
            "min_ms": "min ms", "gb_per_s": "GB/s", "of_copy": "of copy"}


def table_row(row: dict, columns=_COLUMNS) -> str:
    """One line of a kernels table: columns are (key, width, format spec), text left-aligned, numbers right."""
    cells = []
    for key, width, spec in columns:
        value = row.get(key)
        text = "-" if value is None else f"{value:{spec}}"
        cells.append(f"{text:{'<' if spec == 's' else '>'}{width}}")
    return "  ".join(cells)


def table_header(columns=_COLUMNS, headers=_HEADERS) -> str:
    return "  ".join(f"{headers.get(key, key):{'<' if spec == 's' else '>'}{width}}" for key, width, spec in columns)


def format_table(rows: list[dict], shape: AttentionShape = AttentionShape(),
                 copy_gb_per_s: float | None = None, matmul_gflops: dict[str, float] | None = None) -> str:
    header = table_header()
    title = (f"paged attention, one layer per call · Hq={shape.num_q_heads} Hkv={shape.num_kv_heads} "
             f"D={shape.head_dim} block {shape.block_size} · {torch.get_num_threads()} torch threads")
    lines = [title, header, *(table_row(row) for row in rows)]
    if copy_gb_per_s:
        lines.append(f"copy bandwidth: {copy_gb_per_s:.1f} GB/s (read + written by one {_COPY_BYTES // 2**20} MiB "
                     f"copy_); GB/s above counts K/V bytes read, 'of copy' is that against it")
    if matmul_gflops:
        reached = ", ".join(f"{dtype} {gflops:,.0f} GFLOP/s" for dtype, gflops in matmul_gflops.items())
        lines.append(f"matmul peak: {reached} (best [2048, 576] x [576, 3072] product through the engine's packed "
                     f"linear): the denominator of the workload table's MFU")
    return "\n".join(lines)
